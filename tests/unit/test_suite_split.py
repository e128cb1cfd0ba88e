"""``make test``'s serial part on several processes keeps each group in one of them.

The fault scenarios share one set of simulators and judge deadlines: they must
run one after another in one process, and a module of serial tests whole in
one process (a bench smoke's run is module-scoped). The groups are added at
collection (``xdist_group``), and pytest-xdist's ``--dist loadgroup`` honours
them only on pytest versions where it can suffix a node id (not on 9.2): a
child run proves the installed pair still groups.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

CHILD = """
import pytest

@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups, as the project's conftests
def pytest_collection_modifyitems(items):
    for item in items:
        item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))
"""


def _workers(out: str) -> dict[str, set[str]]:
    """Test file -> the workers that ran its tests, from ``-v`` lines."""
    seen: dict[str, set[str]] = {}
    for worker, nodeid in re.findall(r"\[(gw\d+)\] \[\s*\d+%\] PASSED (\S+)", out):
        seen.setdefault(nodeid.split("::")[0], set()).add(worker)
    return seen


def test_groups_added_at_collection_keep_each_module_on_one_worker(tmp_path: Path) -> None:
    (tmp_path / "conftest.py").write_text(CHILD)
    for name in ("a", "b", "c"):
        (tmp_path / f"test_{name}.py").write_text(
            "import pytest\n\n@pytest.mark.parametrize('i', range(6))\ndef test_it(i):\n    pass\n"
        )
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-n",
        "2",
        "--dist",
        "loadgroup",
        "-v",
        "-p",
        "no:cacheprovider",
    ]
    result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stdout[-2000:]
    seen = _workers(result.stdout)
    assert sorted(seen) == ["test_a.py", "test_b.py", "test_c.py"]
    assert all(len(workers) == 1 for workers in seen.values()), seen
    assert set().union(*seen.values()) == {"gw0", "gw1"}  # and both workers had some


PROBE = """
import pytest

@pytest.hookimpl(trylast=True)
def pytest_collection_finish(session):
    for item in session.items:
        groups = sorted(mark.args[0] for mark in item.iter_markers("xdist_group"))
        print("GROUP", item.nodeid, ",".join(groups))
"""


def test_the_fault_scenarios_are_one_group_and_serial_modules_each_their_own(tmp_path: Path) -> None:
    (tmp_path / "groups_probe.py").write_text(PROBE)
    command = [
        sys.executable,
        "-m",
        "pytest",
        "--collect-only",
        "-q",
        "-p",
        "no:cacheprovider",
        "-p",
        "groups_probe",
    ]
    command += ["-m", "serial and not netns", "tests/faults", "tests/integration/test_bench_smoke.py"]
    command += ["tests/integration/test_workers.py"]
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    result = subprocess.run(
        command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    groups = dict(line.split(" ")[1:3] for line in result.stdout.splitlines() if line.startswith("GROUP "))
    faults = {nodeid: group for nodeid, group in groups.items() if nodeid.startswith("tests/faults/")}
    assert len(faults) > 20 and set(faults.values()) == {"faults"}
    others = {nodeid: group for nodeid, group in groups.items() if nodeid not in faults}
    assert {nodeid.split("::")[0] for nodeid in others} == {
        "tests/integration/test_bench_smoke.py",
        "tests/integration/test_workers.py",
    }
    assert all(group == nodeid.split("::")[0] for nodeid, group in others.items()), others


MARKS = """
import pytest

@pytest.hookimpl(trylast=True)
def pytest_collection_finish(session):
    for item in session.items:
        marks = [name for name in ("serial", "netns") if item.get_closest_marker(name)]
        print("MARKS", item.nodeid.split("::")[0], ",".join(marks) or "-")
"""


def _make_test_paths(marker: str) -> set[str]:
    """The paths ``make test``'s run selecting ``-m <marker>...`` is given (from ``make -n test``)."""
    dry = subprocess.run(["make", "-n", "test"], cwd=ROOT, capture_output=True, text=True, check=True)
    lines = dry.stdout.replace("\\\n", " ").splitlines()
    line = next(line for line in lines if f'-m "{marker}' in line or f"-m {marker}" in line)
    return {word for word in line.split() if word.startswith("tests/")}


def test_the_serial_and_netns_runs_are_given_every_file_that_holds_their_tests(tmp_path: Path) -> None:
    """``make test`` gives its serial and netns runs only some paths: none of their tests is left out."""
    (tmp_path / "marks_probe.py").write_text(MARKS)
    command = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"]
    command += ["-p", "marks_probe", "-m", "serial or netns", "tests"]
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    result = subprocess.run(
        command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    marks = [line.split()[1:3] for line in result.stdout.splitlines() if line.startswith("MARKS ")]
    serial_files = {name for name, found in marks if "serial" in found}
    netns_files = {name for name, found in marks if "netns" in found}
    assert "tests/integration/test_bench_smoke.py" in serial_files and netns_files  # the probe saw them
    serial_paths, netns_paths = _make_test_paths("serial"), _make_test_paths("netns")
    assert "tests/faults" in serial_paths
    missed = {
        name for name in serial_files if name not in serial_paths and not name.startswith("tests/faults/")
    }
    assert not missed, f"serial tests make test would not collect: {sorted(missed)}"
    assert netns_files <= netns_paths, (
        f"netns tests make test would not collect: {sorted(netns_files - netns_paths)}"
    )
