"""Release day for what the sidecar is built on: ``make deps-release [PKG=name [VERSION=X]]``.

``python -m tests.deps_release [--package NAME [--version X]]`` asks the
package index (``pip index versions``) for the newest final release of every
runtime dependency (the core's and every extra's, as ``pyproject.toml``
names them for this platform), or of the one package named. In a scratch
environment (``out/deps-release/venv``), made exactly as ``uv.lock`` says
(``uv sync --frozen``, the dev group and every extra, as ``.venv``), it
installs those releases over the lock (``uv pip install``: each named
package's newest release that resolves beside the newest of the others, or
NAME at X; what they need comes along, everything else stays as locked;
torch is kept out as everywhere), then runs the unit and integration suites
there, as ``make test`` runs them. The project's own bounds are not applied:
the question of the day is whether a release they exclude works.

It prints one row per runtime dependency: the locked version, the index's
newest, the version tested, and the suite's result; then every other package
the install moved. When the suites fail with several packages moved, each is
tried alone over the lock to name the one that breaks them. Exit status: 0
when the suites passed (or nothing moved: the scratch environment is then
the lock's, which ``make test`` answers for), 1 when they failed, 2 when the
lane could not run (no index, an unknown package, not a version, a release
that does not resolve). Not part of ``make test`` or CI: its answer depends on
what the index holds that day (docs/testing.md, "When a dependency releases").
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from packaging.markers import Marker, default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

ROOT = Path(__file__).resolve().parents[1]
SCRATCH = ROOT / "out" / "deps-release" / "venv"
NO_TORCH = ROOT / "requirements" / "no-torch.txt"
SUITES = ("tests/unit", "tests/integration")
SERIAL_WORKERS = 3  # as make test's SERIAL_WORKERS
MARKED = re.compile(r"mark\.(serial|netns|alone)")


class LaneError(Exception):
    """The lane could not run: no index, an unknown package, not a version, no resolution."""


# --- what the project declares and locks -------------------------------------------------------


def runtime_dependencies(pyproject: Mapping[str, Any], environment: Mapping[str, str]) -> list[str]:
    """The canonical names of the core's and every extra's requirements that apply on ``environment``,
    in the order pyproject.toml gives them (the dev group is not a runtime dependency)."""
    project = pyproject["project"]
    groups = [project.get("dependencies", []), *project.get("optional-dependencies", {}).values()]
    names: dict[str, None] = {}
    for requirement in (Requirement(text) for group in groups for text in group):
        if requirement.marker is None or requirement.marker.evaluate({**environment, "extra": ""}):
            names[canonicalize_name(requirement.name)] = None
    return list(names)


def locked_versions(lock: Mapping[str, Any], environment: Mapping[str, str]) -> dict[str, str]:
    """Each package's version in ``uv.lock`` for ``environment`` (a package locked at two versions
    for two Python ranges gives the one whose ``resolution-markers`` hold)."""
    versions: dict[str, str] = {}
    for package in lock.get("package", []):
        name, markers = canonicalize_name(package["name"]), package.get("resolution-markers")
        if "version" not in package:
            continue
        if markers and not any(Marker(marker).evaluate(dict(environment)) for marker in markers):
            continue
        versions.setdefault(name, package["version"])
    return versions


def newest_final(listing: str, name: str) -> str:
    """The newest final release in ``pip index versions``' output (pre- and dev releases excluded)."""
    match = re.search(r"^Available versions:\s*(.+)$", listing, re.MULTILINE)
    if match is None:
        raise LaneError(f"{name}: no 'Available versions:' line in pip's answer: {listing.strip()[:300]!r}")
    finals = []
    for text in (v.strip() for v in match[1].split(",")):
        try:
            version = Version(text)
        except InvalidVersion:
            continue
        if not version.is_prerelease:
            finals.append(version)
    if not finals:
        raise LaneError(f"the package index lists no final release of {name}")
    return str(max(finals))


def frozen(freeze: str) -> dict[str, str]:
    """``name==version`` lines of ``uv pip freeze`` as a map of canonical names (editables left out)."""
    found = {}
    for line in freeze.splitlines():
        name, sep, version = line.strip().partition("==")
        if sep and not name.startswith("-"):
            found[canonicalize_name(name)] = version
    return found


# --- the table ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Row:
    name: str
    locked: str
    newest: str
    tested: str
    result: str


def rows(
    names: Sequence[str],
    locked: Mapping[str, str],
    newest: Mapping[str, str],
    tested: Mapping[str, str],
    result: str,
) -> list[Row]:
    """One row per dependency; ``result`` (the suites') goes to each one the install moved."""
    table = []
    for name in names:
        was, now = locked.get(name, "-"), tested.get(name, "-")
        if now != was:
            verdict = result
        elif newest.get(name, was) != was:
            verdict = "held at the lock: newest does not resolve beside the rest"
        else:
            verdict = "unchanged"
        table.append(Row(name, was, newest.get(name, "-"), now, verdict))
    return table


def render(table: Sequence[Row], moved: Mapping[str, tuple[str, str]]) -> str:
    """The table, then each other package the install moved (``moved``: name -> (locked, tested))."""
    head = ("package", "locked", "newest", "tested", "suite result")
    cells = [head, *((r.name, r.locked, r.newest, r.tested, r.result) for r in table)]
    widths = [max(len(row[i]) for row in cells) for i in range(4)]
    lines = ["  ".join([*(cell.ljust(width) for cell, width in zip(row, widths, strict=False)), row[4]])
             for row in cells]  # fmt: skip
    lines.insert(1, "-" * len(lines[0]))
    if moved:
        lines += ["", "also moved by the install (not runtime dependencies the project names):"]
        lines += [f"  {name} {was} -> {now}" for name, (was, now) in sorted(moved.items())]
    return "\n".join(lines)


def exit_code(results: Sequence[bool | None]) -> int:
    """0 when no suite run failed (None: not run), 1 when one did."""
    return 1 if any(result is False for result in results) else 0


# --- arguments ------------------------------------------------------------------------------


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m tests.deps_release", description=__doc__.splitlines()[0])
    parser.add_argument("--package", default="", help="only this package (default: every runtime dependency)")
    parser.add_argument(
        "--version", default="", help="the release of --package to test (default: its newest)"
    )
    parser.add_argument("--workers", type=int, default=4, help="pytest-xdist workers (as make test's)")
    parser.add_argument("--no-suite", action="store_true", help="resolve and print the table only")
    parser.add_argument("--uv", default="", help="the uv to use (default: .tools/bin/uv, else PATH's)")
    args = parser.parse_args(argv)
    if args.version and not args.package:
        parser.error("--version needs --package (make deps-release PKG=name VERSION=X)")
    if args.version:
        try:
            Version(args.version)
        except InvalidVersion:
            parser.error(f"{args.version!r} is not a version (like 0.55.0)")
    return args


def request(
    installed: Sequence[str],
    names: Sequence[str],
    locked: Mapping[str, str],
    newest: Mapping[str, str],
    package: str,
    version: str,
) -> tuple[list[str], list[str]]:
    """What ``uv pip install`` is asked over the lock: every package installed, so each one's own
    requirements hold (the project's are left out: its bounds are what is tested beyond), and
    ``package`` at ``version`` (or its newest), or else every runtime dependency whose newest is not
    the locked one to be upgraded (to its newest that resolves beside the rest). Returns the
    requirements and the packages to upgrade."""
    if package:
        pinned = f"{package}=={version or newest[package]}"
        return [*(name for name in installed if name != package), pinned], []
    upgrade = [name for name in names if newest.get(name, locked.get(name)) != locked.get(name)]
    return list(installed), upgrade


# --- what the lane does outside: the index, the environment, the suites ---------------------------


@dataclass(frozen=True, slots=True)
class Outside:
    """The lane's side effects, replaced by fakes in its tests."""

    index: Callable[[str], str]  # package -> pip index versions' output
    sync: Callable[[], None]  # the scratch environment made exactly as uv.lock says
    install: Callable[[list[str], list[str]], None]  # requirements, the packages to upgrade
    freeze: Callable[[], str]  # uv pip freeze of the scratch environment
    suites: Callable[[], bool]  # the unit and integration suites there; True when they passed


def find_uv(named: str) -> str:
    for candidate in (named, str(ROOT / ".tools" / "bin" / "uv"), shutil.which("uv") or ""):
        if candidate and Path(candidate).exists():
            return candidate
    raise LaneError("no uv to make the scratch environment with (make deps-release installs one)")


def _run(command: list[str], **options: Any) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"} | options.pop("env", {})
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, check=False, **options)


def real(uv: str, workers: int) -> Outside:
    python = str(SCRATCH / "bin" / "python")

    def index(name: str) -> str:
        done = _run([sys.executable, "-m", "pip", "index", "versions", name], timeout=300)
        if done.returncode != 0:
            raise LaneError(f"pip index versions {name}: {(done.stderr or done.stdout).strip()[-500:]}")
        return done.stdout

    def sync() -> None:
        SCRATCH.parent.mkdir(parents=True, exist_ok=True)
        command = [uv, "sync", "--frozen", "--quiet", "--python", sys.executable]
        done = _run(command, env={"UV_PROJECT_ENVIRONMENT": str(SCRATCH)}, timeout=1800)
        if done.returncode != 0:
            raise LaneError(f"uv sync into {SCRATCH}: {done.stderr.strip()[-800:]}")

    def install(requirements: list[str], upgrade: list[str]) -> None:
        command = [uv, "pip", "install", "--quiet", "--python", python, "--override", str(NO_TORCH)]
        command += [f"--upgrade-package={name}" for name in upgrade]
        done = _run([*command, *requirements], timeout=1800)
        if done.returncode != 0:
            asked = " ".join(upgrade or [r for r in requirements if "==" in r])
            raise LaneError(f"{asked} does not resolve over the lock: {done.stderr.strip()[-1500:]}")

    def freeze() -> str:
        return _run([uv, "pip", "freeze", "--python", python], timeout=300).stdout

    def suites() -> bool:
        passed = True
        for command in suite_commands(python, workers):
            print(f"\n$ {' '.join(command[1:])}", flush=True)
            status = subprocess.run(command, cwd=ROOT, check=False).returncode
            passed = passed and status in (0, 5)  # 5: this run selected no test
        return passed

    return Outside(index, sync, install, freeze, suites)


def suite_commands(python: str, workers: int, root: Path = ROOT) -> list[list[str]]:
    """``make test``'s three pytest runs over the unit and integration suites: the parallel part, the
    tests marked serial, then those marked netns or alone, by themselves."""
    marked: dict[str, list[str]] = {"serial": [], "alone": []}
    for path in sorted(p for suite in SUITES for p in (root / suite).rglob("test_*.py")):
        found = set(MARKED.findall(path.read_text()))
        relative = str(path.relative_to(root))
        if found & {"serial", "netns"}:
            marked["serial"].append(relative)
        if found & {"netns", "alone"}:
            marked["alone"].append(relative)
    pytest = [python, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    return [
        [*pytest, "-n", str(workers), "-m", "not serial", *SUITES],
        [*pytest, "-n", str(SERIAL_WORKERS), "--dist", "loadgroup",
         "-m", "serial and not netns and not alone", *marked["serial"]],
        [*pytest, "-m", "netns or alone", *marked["alone"]],
    ]  # fmt: skip


# --- the lane -------------------------------------------------------------------------------------


def lane(
    args: argparse.Namespace, outside: Outside, pyproject: Mapping[str, Any], lock: Mapping[str, Any]
) -> int:
    environment = dict(default_environment())
    names = runtime_dependencies(pyproject, environment)
    locked = locked_versions(lock, environment)
    package = canonicalize_name(args.package) if args.package else ""
    if package and package not in locked:
        raise LaneError(f"{args.package} is not in uv.lock: runtime dependencies are {', '.join(names)}")
    if package and package not in names:
        names.append(package)  # a package the runtime dependencies pull in: tested all the same
    newest = {name: newest_final(outside.index(name), name) for name in ([package] if package else names)}
    outside.sync()
    before = frozen(outside.freeze())
    requirements, upgrade = request(sorted(before), names, locked, newest, package, args.version)
    asked = [r for r in requirements if "==" in r] + upgrade
    print(f"over uv.lock in {SCRATCH}: " + (", ".join(asked) or "nothing newer than the lock"), flush=True)
    if asked:
        outside.install(requirements, upgrade)
    after = frozen(outside.freeze())
    moved = {name: (before.get(name, "-"), now) for name, now in after.items() if before.get(name) != now}
    moved |= {name: (was, "-") for name, was in before.items() if name not in after}
    changed = [name for name in names if name in moved]
    results: list[bool | None] = []
    if not moved:
        summary = "nothing moved: the scratch environment is the lock's (make test answers for it)"
        table = rows(names, locked, newest, after, "unchanged")
    elif args.no_suite:
        summary = "suites not run"
        table = rows(names, locked, newest, after, "not run")
    else:
        passed = outside.suites()
        results.append(passed)
        summary = "the unit and integration suites " + ("passed" if passed else "FAILED")
        table = rows(names, locked, newest, after, "passed" if passed else "FAILED")
        if not passed and len(changed) > 1:
            table = _alone(table, changed, before, after, outside)
    print()
    print(render(table, {n: m for n, m in moved.items() if n not in names}))
    code = exit_code(results)
    moved_count = f"{len(changed)} runtime dependenc{'y' if len(changed) == 1 else 'ies'} moved"
    print(f"\n{moved_count}; {summary}; exit {code}")
    return code


def _alone(
    table: list[Row],
    changed: list[str],
    before: Mapping[str, str],
    after: Mapping[str, str],
    outside: Outside,
) -> list[Row]:
    """The suites again with each moved dependency alone over the lock: which one breaks them."""
    verdicts = {}
    for name in changed:
        print(f"\n--- {name} {after[name]} alone over the lock", flush=True)
        outside.sync()
        outside.install([*(n for n in sorted(before) if n != name), f"{name}=={after[name]}"], [])
        verdicts[name] = "FAILED alone" if not outside.suites() else "passed alone (fails with the others)"
    return [replace(row, result=verdicts.get(row.name, row.result)) for row in table]


def main(argv: Sequence[str] | None = None, outside: Outside | None = None) -> int:
    args = parse(argv)
    try:
        pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
        lock = tomllib.loads((ROOT / "uv.lock").read_text())
        return lane(args, outside or real(find_uv(args.uv), args.workers), pyproject, lock)
    except LaneError as exc:
        print(f"deps-release: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
