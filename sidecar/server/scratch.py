"""The supervisor's private directory in shared memory (``workers``), and the sweep of dead ones.

The directory holds the shared table (``sidecar.release.shared``), each
worker's admin socket and the InferencePool lists (``sidecar.k8s.shared``).
The supervisor removes it when it exits; one killed with SIGKILL (or by the
out-of-memory killer) cannot, and the table, sized for ``ledger_size``, would
stay in ``/dev/shm`` (a container's is often 64 MiB).
So every directory carries an ``owner`` file that the supervisor and each of
its workers hold a shared ``flock`` on while they run; the kernel lets go of
it when a process dies, whatever killed it. A new supervisor removes every
directory whose ``owner`` it can lock exclusively at once: no process of that
fleet is left. A directory some process still holds is never touched (a live
supervisor's, or a dead supervisor's workers still draining), whichever PID
namespace it runs in, and a reused PID changes nothing. The directory is made
under a name the sweep does not look at, and takes its final name only once
its ``owner`` is held, so a sweep never sees one being made. Directories
without an ``owner`` (made by an older version) are left alone.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import tempfile
from pathlib import Path

log = logging.getLogger("sidecar.serve")

PREFIX = "kvr-workers-"
_MAKING = ".kvr-making-"
OWNER = "owner"


def shm() -> Path:
    """``/dev/shm`` when there is one (the table stays in memory), else the temporary directory."""
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
        return Path("/dev/shm")
    return Path(tempfile.gettempdir())


def hold(directory: Path) -> int:
    """A shared lock on ``directory``'s ``owner``, held until the returned descriptor is closed
    (or the process dies): the directory is in use."""
    fd = os.open(directory / OWNER, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_SH)
    return fd


def make(parent: Path) -> tuple[Path, int]:
    """A new private directory under ``parent``, and the descriptor holding its ``owner``."""
    making = Path(tempfile.mkdtemp(prefix=_MAKING, dir=parent))
    fd = hold(making)
    final = parent / (PREFIX + making.name.removeprefix(_MAKING))
    os.rename(making, final)
    return final, fd


def sweep(parent: Path) -> list[Path]:
    """Remove the directories under ``parent`` no live process holds; the ones removed."""
    removed = []
    for directory in sorted(parent.glob(PREFIX + "*")):
        if _abandoned(directory):
            shutil.rmtree(directory, ignore_errors=True)
            removed.append(directory)
    if removed:
        paths = [str(p) for p in removed]
        log.info("removed directories left by stopped supervisors", extra={"paths": paths})
    return removed


def _abandoned(directory: Path) -> bool:
    try:
        if directory.is_symlink() or directory.stat().st_uid != os.getuid():
            return False  # another user's, or a link: not ours to judge
        fd = os.open(directory / OWNER, os.O_RDWR | os.O_NOFOLLOW)
    except OSError:  # not ours to judge: no owner file, gone meanwhile
        return False
    try:
        if os.fstat(fd).st_uid != os.getuid():
            return False
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False  # held: a process of that fleet runs
    finally:
        with contextlib.suppress(OSError):
            os.close(fd)  # closing lets go of the lock at once: removing needs none
    return True
