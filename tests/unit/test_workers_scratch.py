"""The supervisor's shared-memory directory: a new supervisor removes those no live process holds.

Processes here are real: a child holds a directory's ``owner`` and is then
killed with SIGKILL, as a supervisor killed by the out-of-memory killer is.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from sidecar.server import scratch

HOLD = (
    "import sys; from pathlib import Path; from sidecar.server import scratch; "
    "scratch.hold(Path(sys.argv[1])); print('held', flush=True); sys.stdin.read()"
)


def holder(directory: Path) -> subprocess.Popen[str]:
    """A process that holds ``directory`` (as a supervisor or worker does) until it is killed."""
    child = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(directory)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert child.stdout is not None and child.stdout.readline() == "held\n"
    return child


def kill(child: subprocess.Popen[str]) -> None:
    """SIGKILL, as the out-of-memory killer sends; waited for, its pipes closed."""
    os.kill(child.pid, signal.SIGKILL)
    child.communicate()


def test_a_directory_is_removed_once_every_process_holding_it_is_dead(tmp_path: Path) -> None:
    directory, fd = scratch.make(tmp_path)
    (directory / "ledger").write_bytes(b"x" * 4096)
    worker = holder(directory)
    os.close(fd)  # the supervisor dies; its worker is still draining
    assert scratch.sweep(tmp_path) == [] and directory.is_dir()
    kill(worker)
    assert scratch.sweep(tmp_path) == [directory]
    assert not directory.exists()


def test_a_live_supervisor_s_directory_is_kept_beside_a_dead_one_s(tmp_path: Path) -> None:
    live, live_fd = scratch.make(tmp_path)
    dead, dead_fd = scratch.make(tmp_path)
    other = holder(live)  # a process of the live fleet other than the one holding live_fd
    os.close(dead_fd)
    try:
        assert scratch.sweep(tmp_path) == [dead]
        assert live.is_dir() and (live / scratch.OWNER).exists()
        os.close(live_fd)
        assert scratch.sweep(tmp_path) == []  # its worker still holds it
    finally:
        kill(other)
    assert scratch.sweep(tmp_path) == [live]


def test_directories_it_cannot_judge_are_left_alone(tmp_path: Path) -> None:
    older = tmp_path / f"{scratch.PREFIX}older"  # no owner file: an older version's, maybe live
    older.mkdir()
    unrelated = tmp_path / "psm_1234"
    unrelated.mkdir()
    (unrelated / scratch.OWNER).touch()
    making = tmp_path / ".kvr-making-x"  # still being made: never swept
    making.mkdir()
    (making / scratch.OWNER).touch()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    dead, fd = scratch.make(elsewhere)
    os.close(fd)
    (tmp_path / f"{scratch.PREFIX}link").symlink_to(dead)  # a link to a dead one: not followed
    assert scratch.sweep(tmp_path) == []
    assert older.is_dir() and unrelated.is_dir() and making.is_dir() and dead.is_dir()


def test_the_directory_takes_its_name_with_its_owner_held(tmp_path: Path) -> None:
    directory, fd = scratch.make(tmp_path)
    try:
        assert directory.name.startswith(scratch.PREFIX) and directory.parent == tmp_path
        assert (directory / scratch.OWNER).exists()
        assert [p.name for p in tmp_path.iterdir()] == [directory.name]  # nothing left half-made
        assert oct(directory.stat().st_mode & 0o777) == oct(0o700)  # private
    finally:
        os.close(fd)
