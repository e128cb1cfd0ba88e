"""The arm64 lane's host side (``tests.arm64``): what it refuses, in one line and at once, and its limits.

The lane itself needs root and runs for minutes (``make arm64``,
``make arm64-proof``); here the checks it makes before anything else, the
cache's key, and the time limit on a step, without root.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.arm64 import __main__ as cli
from tests.arm64 import lane
from tests.support.emulation import quick


def test_without_root_the_lane_stops_at_once_saying_so(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(lane.os, "geteuid", lambda: 1000)
    monkeypatch.setattr(lane.platform, "machine", lambda: "x86_64")
    assert cli.main(["--proof"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "needs root" in err[0] and "sudo make arm64" in err[0]


def test_another_machine_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lane.platform, "machine", lambda: "riscv64")
    with pytest.raises(lane.LaneError, match=r"x86_64 .* or aarch64 hosts, not riscv64"):
        lane.Host.here()


def test_binfmt_that_cannot_be_mounted_is_a_clear_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(lane, "BINFMT", tmp_path / "binfmt_misc")  # not mounted: no status file

    def refused(command: list[str], limit: float, what: str) -> None:
        raise lane.LaneError(f"{what} failed (exit 32): permission denied")

    monkeypatch.setattr(lane, "run", refused)
    with pytest.raises(lane.LaneError, match=r"binfmt_misc is not mounted and cannot be .*privileged"):
        lane.binfmt(lane.Host("x86_64", emulated=True))
    assert lane.binfmt(lane.Host("aarch64", emulated=False)) is None  # native: nothing to register


def test_a_disabled_qemu_entry_is_a_clear_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    binfmt = tmp_path / "binfmt_misc"
    binfmt.mkdir()
    (binfmt / "status").write_text("enabled\n")
    (binfmt / "qemu-aarch64").write_text("disabled\ninterpreter /usr/libexec/qemu-binfmt/aarch64-binfmt-P\n")
    monkeypatch.setattr(lane, "BINFMT", binfmt)
    with pytest.raises(lane.LaneError, match="qemu-aarch64 binfmt entry is disabled"):
        lane.binfmt(lane.Host("x86_64", emulated=True))
    (binfmt / "qemu-aarch64").write_text(
        "enabled\ninterpreter /usr/libexec/qemu-binfmt/aarch64-binfmt-P\nflags: POF\n"
    )
    assert lane.binfmt(lane.Host("x86_64", emulated=True)) == Path(
        "/usr/libexec/qemu-binfmt/aarch64-binfmt-P"
    )


def test_a_step_past_its_limit_is_stopped_with_its_children(tmp_path: Path) -> None:
    child = tmp_path / "child.pid"
    started = time.monotonic()
    with pytest.raises(lane.LaneError, match="sleeping: no end after 1 s; stopped"):
        lane.run(["sh", "-c", f"sleep 60 & echo $! > {child}; sleep 60"], 1, "sleeping")
    assert quick(time.monotonic() - started, 10.0)
    pid = int(child.read_text())
    deadline = time.monotonic() + 30
    while _running(pid):
        assert time.monotonic() < deadline, "the step's child outlived it"
        time.sleep(0.01)


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_failed_command_says_what_it_printed() -> None:
    with pytest.raises(lane.LaneError, match=r"probe failed \(exit 3\): no such thing"):
        lane.run(["sh", "-c", "echo no such thing; exit 3"], 10, "probe")


def test_the_root_is_cached_by_what_it_is_made_of(monkeypatch: pytest.MonkeyPatch) -> None:
    key = lane.root_key()
    monkeypatch.setattr(lane, "PACKAGES", (*lane.PACKAGES, "git"))
    assert lane.root_key() != key
    monkeypatch.setattr(lane, "PACKAGES", tuple(reversed(lane.PACKAGES)))
    assert lane.root_key() == lane.root_key()  # the order of the list does not matter


def test_the_root_holds_what_make_and_the_wheels_need() -> None:
    # make's bootstrap (python3 -m venv, then pip), the Makefile's shell, and the system library
    # manylinux wheels such as pyzmq's link to (libstdc++.so.6).
    assert {"python3", "python3-venv", "make", "dash", "libstdc++6"} <= set(lane.PACKAGES)
    assert {"nginx-light", "haproxy", "wrk"} <= set(lane.PACKAGES)  # make test's tools, for arm64


def test_the_steps_assert_no_duration_under_emulation() -> None:
    run = lane.Run(Path("/nonexistent"), Path("/nonexistent"), emulated=True, interpreter=None)
    assert "KVR_EMULATED=1" in run.environment()
    native = lane.Run(Path("/nonexistent"), Path("/nonexistent"), emulated=False, interpreter=None)
    assert not any(v.startswith("KVR_EMULATED") for v in native.environment())
    proof = " ".join(command for _, command, _ in (cli.INSTALL, cli.PROOF))
    assert (
        "make .venv/.synced" in proof and "test_shared_table.py" in proof and "test_pd_release_e2e" in proof
    )
