"""``make deps-release``: what it reads, asks, prints and exits with, on a fake index and environment.

The lane itself (``tests.deps_release``) asks the package index and installs
into a scratch environment; here every side effect is a fake (``Outside``), so
these tests need no network: the table, the exit status, the arguments, the
packages tried alone when the suites fail, and the make target's arguments.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable
from typing import Any

import pytest

from tests import deps_release
from tests.deps_release import ROOT, LaneError, Outside, Row

LINUX_311 = {"sys_platform": "linux", "platform_machine": "x86_64", "python_version": "3.11",
             "python_full_version": "3.11.9"}  # fmt: skip

PYPROJECT: dict[str, Any] = {
    "project": {
        "dependencies": ["starlette>=0.46", "uvicorn>=0.34", "uvloop>=0.21; sys_platform != 'win32'"],
        "optional-dependencies": {
            "nixl": ["nixl-cu12>=1.0; sys_platform == 'linux' and platform_machine == 'x86_64'", "pyzmq>=26"],
            "llm-d": ["pyyaml>=6.0"],
            "otel": ["pyyaml>=6.0", "opentelemetry-sdk>=1.27"],
        },
    },
    "dependency-groups": {"dev": ["pytest>=8.3,<9.2"]},
}
LOCK: dict[str, Any] = {
    "package": [
        {"name": "starlette", "version": "1.10.0"},
        {"name": "uvicorn", "version": "0.54.0"},
        {"name": "uvloop", "version": "0.23.0"},
        {"name": "nixl-cu12", "version": "1.5.1"},
        {"name": "PyZMQ", "version": "27.3.0"},
        {"name": "pyyaml", "version": "6.0.4"},
        {"name": "opentelemetry-sdk", "version": "1.45.2"},
        {"name": "h11", "version": "0.16.0"},
        {"name": "numpy", "version": "2.4.6", "resolution-markers": ["python_full_version < '3.12'"]},
        {"name": "numpy", "version": "2.5.5", "resolution-markers": ["python_full_version >= '3.12'"]},
        {"name": "kv-release-sidecar", "source": {"editable": "."}},
    ]
}


def test_runtime_dependencies_are_the_core_and_every_extra_that_applies_here() -> None:
    names = deps_release.runtime_dependencies(PYPROJECT, LINUX_311)
    assert names == ["starlette", "uvicorn", "uvloop", "nixl-cu12", "pyzmq", "pyyaml", "opentelemetry-sdk"]
    arm = deps_release.runtime_dependencies(PYPROJECT, {**LINUX_311, "platform_machine": "aarch64"})
    assert "nixl-cu12" not in arm and "pytest" not in arm  # not on this platform; the dev group


def test_the_locked_version_is_the_one_for_this_python() -> None:
    locked = deps_release.locked_versions(LOCK, LINUX_311)
    assert locked["numpy"] == "2.4.6" and locked["pyzmq"] == "27.3.0"  # names canonical
    newer = deps_release.locked_versions(LOCK, {**LINUX_311, "python_full_version": "3.13.1"})
    assert newer["numpy"] == "2.5.5" and "kv-release-sidecar" not in newer


def test_newest_final_orders_versions_and_skips_pre_releases() -> None:
    listing = "uvicorn (0.10.0rc1)\nAvailable versions: 0.10.0rc1, 0.9.2, 0.10.0.dev3, 0.9.10, 0.8.0\n"
    assert deps_release.newest_final(listing, "uvicorn") == "0.9.10"
    with pytest.raises(LaneError, match="no final release of x"):
        deps_release.newest_final("Available versions: 1.0a1\n", "x")
    with pytest.raises(LaneError, match="no 'Available versions:' line"):
        deps_release.newest_final("ERROR: No matching distribution found for x", "x")


def test_freeze_lines_become_a_map_of_canonical_names() -> None:
    text = "PyYAML==6.0.4\n-e file:///work/kv-release-sidecar\nuvicorn==0.55.0\n"
    assert deps_release.frozen(text) == {"pyyaml": "6.0.4", "uvicorn": "0.55.0"}


def test_what_is_asked_of_the_installer() -> None:
    installed = ["h11", "starlette", "uvicorn"]
    locked = {"starlette": "1.10.0", "uvicorn": "0.54.0"}
    newest = {"starlette": "1.10.0", "uvicorn": "0.55.0"}
    # every package installed, so each one's own pins hold; the newer runtime dependencies upgraded
    assert deps_release.request(installed, ["starlette", "uvicorn"], locked, newest, "", "") == (
        installed, ["uvicorn"]
    )  # fmt: skip
    # one package: at the version named, else its newest, the rest as they are
    asked = deps_release.request(installed, [], locked, newest, "uvicorn", "0.53.0")
    assert asked == (["h11", "starlette", "uvicorn==0.53.0"], [])
    assert deps_release.request(installed, [], locked, newest, "uvicorn", "")[0][-1] == "uvicorn==0.55.0"


def test_rows_say_what_moved_and_what_the_resolver_held_back() -> None:
    locked = {"a": "1", "b": "1", "c": "1"}
    newest = {"a": "2", "b": "2", "c": "1"}
    table = deps_release.rows(["a", "b", "c"], locked, newest, {"a": "2", "b": "1", "c": "1"}, "passed")
    assert [(r.name, r.tested, r.result) for r in table] == [
        ("a", "2", "passed"),
        ("b", "1", "held at the lock: newest does not resolve beside the rest"),
        ("c", "1", "unchanged"),
    ]


def test_render_gives_a_column_each_and_the_other_packages_moved() -> None:
    table = [Row("uvicorn", "0.54.0", "0.55.0", "0.55.0", "FAILED"), Row("h", "1", "1", "1", "unchanged")]
    lines = deps_release.render(table, {"h11": ("0.16.0", "0.17.0")}).splitlines()
    assert lines[0].split() == ["package", "locked", "newest", "tested", "suite", "result"]
    assert set(lines[1]) == {"-"}
    assert lines[2].split() == ["uvicorn", "0.54.0", "0.55.0", "0.55.0", "FAILED"]
    assert lines[2].index("0.55.0") == lines[0].index("newest")  # the columns line up
    assert lines[-1] == "  h11 0.16.0 -> 0.17.0"


@pytest.mark.parametrize(
    ("results", "code"), [([], 0), ([None], 0), ([True], 0), ([True, False], 1), ([False], 1)]
)
def test_exit_code(results: list[bool | None], code: int) -> None:
    assert deps_release.exit_code(results) == code


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--version", "0.55.0"], "--version needs --package"),
        (["--package", "uvicorn", "--version", "latest"], "'latest' is not a version"),
    ],
)
def test_bad_arguments_exit_2(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        deps_release.main(argv)
    assert exited.value.code == 2 and message in capsys.readouterr().err


def test_the_suites_run_as_make_test_runs_them() -> None:
    first, serial, alone = deps_release.suite_commands("py", 4)
    assert first[:6] == ["py", "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    assert first[6:] == ["-n", "4", "-m", "not serial", "tests/unit", "tests/integration"]
    assert serial[6:11] == ["-n", "3", "--dist", "loadgroup", "-m"]
    assert "tests/integration/test_workers.py" in serial and "tests/integration/test_llmd_netns.py" in serial
    assert alone[6:8] == ["-m", "netns or alone"] and "tests/integration/test_llmd_netns.py" in alone
    assert not any(path.startswith("tests/faults") for path in serial + alone)  # unit and integration only


def test_make_target_passes_the_package_and_version_through() -> None:
    # a make this runs under (make deps-release itself) passes its own variables down: not here
    outer = ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES", "PKG", "VERSION", "TEST_WORKERS")
    env = {name: value for name, value in os.environ.items() if name not in outer}

    def dry_run(*args: str) -> str:
        command = ["make", "-n", "deps-release", *args]
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env=env)
        assert done.returncode == 0, done.stderr
        lines = done.stdout.replace("\\\n", " ").splitlines()  # the recipe's continued lines, joined
        return " ".join(next(line for line in lines if "deps_release" in line).split())

    assert dry_run("PKG=uvicorn", "VERSION=0.55.0").endswith("--package uvicorn --version 0.55.0")
    assert dry_run().endswith("--workers 4")  # every runtime dependency, at its newest


# --- the lane, end to end on a fake index and environment -------------------------------------------


class FakeWorld:
    """An index, a scratch environment and suites: ``breaks`` are the (package, version) pairs that
    fail the suites; ``resolvable`` the newest each package reaches beside the rest."""

    def __init__(
        self, newest: dict[str, str], resolvable: dict[str, str], breaks: set[tuple[str, str]]
    ) -> None:
        self.locked = {"starlette": "1.10.0", "uvicorn": "0.54.0", "h11": "0.16.0"}
        self.newest, self.resolvable, self.breaks = newest, resolvable, breaks
        self.env: dict[str, str] = {}
        self.suite_runs: list[dict[str, str]] = []
        self.installs: list[tuple[list[str], list[str]]] = []

    def outside(self) -> Outside:
        return Outside(self.index, self.sync, self.install, self.freeze, self.suites)

    def index(self, name: str) -> str:
        if name not in self.newest:
            raise LaneError(f"pip index versions {name}: no index")
        return f"{name} ({self.newest[name]})\nAvailable versions: {self.newest[name]}, 0.1.0\n"

    def sync(self) -> None:
        self.env = dict(self.locked)

    def install(self, requirements: list[str], upgrade: list[str]) -> None:
        self.installs.append((requirements, upgrade))
        for name in upgrade:
            self.env[name] = self.resolvable.get(name, self.env[name])
        for requirement in requirements:
            name, _, version = requirement.partition("==")
            if version:
                self.env[name] = version
                if name == "uvicorn" and version == "0.55.0":
                    self.env["h11"] = "0.17.0"  # what the release needs comes along

    def freeze(self) -> str:
        return "-e file:///checkout\n" + "".join(f"{n}=={v}\n" for n, v in sorted(self.env.items()))

    def suites(self) -> bool:
        self.suite_runs.append(dict(self.env))
        return not any((name, version) in self.breaks for name, version in self.env.items())


TWO: dict[str, Any] = {"project": {"dependencies": ["starlette>=0.46", "uvicorn>=0.34"]}}
TWO_LOCKED = {
    "package": [
        {"name": "starlette", "version": "1.10.0"},
        {"name": "uvicorn", "version": "0.54.0"},
        {"name": "h11", "version": "0.16.0"},
    ]
}


def run(world: FakeWorld, *argv: str) -> int:
    return deps_release.lane(deps_release.parse(list(argv)), world.outside(), TWO, TWO_LOCKED)


def test_nothing_newer_runs_no_suite_and_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    world = FakeWorld({"starlette": "1.10.0", "uvicorn": "0.54.0"}, {}, set())
    assert run(world) == 0
    out = capsys.readouterr().out
    assert world.suite_runs == [] and world.installs == []
    assert "nothing newer than the lock" in out and "the scratch environment is the lock's" in out


def test_newer_releases_that_pass_exit_0_with_their_row(capsys: pytest.CaptureFixture[str]) -> None:
    world = FakeWorld({"starlette": "1.10.0", "uvicorn": "0.55.0"}, {"uvicorn": "0.55.0"}, set())
    assert run(world) == 0
    out = capsys.readouterr().out
    assert world.installs == [(["h11", "starlette", "uvicorn"], ["uvicorn"])]
    assert world.suite_runs == [{"starlette": "1.10.0", "uvicorn": "0.55.0", "h11": "0.16.0"}]
    row = next(line for line in out.splitlines() if line.startswith("uvicorn "))
    assert row.split() == ["uvicorn", "0.54.0", "0.55.0", "0.55.0", "passed"]
    assert "1 runtime dependency moved; the unit and integration suites passed; exit 0" in out


def test_a_failure_names_the_release_that_breaks_the_suites_and_exits_1(
    capsys: pytest.CaptureFixture[str],
) -> None:
    newest = {"starlette": "1.11.0", "uvicorn": "0.55.0"}
    world = FakeWorld(newest, newest, {("uvicorn", "0.55.0")})
    assert run(world) == 1
    out = capsys.readouterr().out
    # all at once, then each alone over the lock
    assert [r["uvicorn"] + "/" + r["starlette"] for r in world.suite_runs] == [
        "0.55.0/1.11.0", "0.54.0/1.11.0", "0.55.0/1.10.0",
    ]  # fmt: skip
    rows = {line.split()[0]: line for line in out.splitlines() if line.startswith(("uvicorn ", "starlette "))}
    assert rows["uvicorn"].endswith("FAILED alone")
    assert rows["starlette"].endswith("passed alone (fails with the others)")
    assert "the unit and integration suites FAILED; exit 1" in out


def test_one_package_at_a_version_and_what_it_brought_along(capsys: pytest.CaptureFixture[str]) -> None:
    world = FakeWorld({"uvicorn": "0.56.0"}, {}, set())
    assert run(world, "--package", "Uvicorn", "--version", "0.55.0") == 0
    out = capsys.readouterr().out
    assert world.installs == [(["h11", "starlette", "uvicorn==0.55.0"], [])]
    row = next(line for line in out.splitlines() if line.startswith("uvicorn "))
    assert row.split() == ["uvicorn", "0.54.0", "0.56.0", "0.55.0", "passed"]
    assert "  h11 0.16.0 -> 0.17.0" in out  # not a runtime dependency the project names


@pytest.mark.parametrize(
    ("argv", "message"),
    [(["--package", "nosuch"], "nosuch is not in uv.lock"), ([], "pip index versions uvicorn: no index")],
)
def test_what_keeps_the_lane_from_running_exits_2(
    argv: list[str], message: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    world = FakeWorld({"starlette": "1.10.0"}, {}, set())
    real: Callable[..., Outside] = lambda uv, workers: world.outside()  # noqa: E731
    monkeypatch.setattr(deps_release, "real", real)
    monkeypatch.setattr(deps_release, "find_uv", lambda named: "uv")
    monkeypatch.setattr(deps_release.tomllib, "loads", _two(deps_release.tomllib.loads))
    assert deps_release.main(argv) == 2
    assert message in capsys.readouterr().err and world.suite_runs == []


def _two(loads: Callable[[str], dict[str, Any]]) -> Callable[[str], dict[str, Any]]:
    """``tomllib.loads`` giving the two-package project and lock above for pyproject.toml and uv.lock."""

    def fake(text: str) -> dict[str, Any]:
        return TWO_LOCKED if "[[package]]" in text else TWO

    return fake
