"""Child processes: start, pin, wait until ready, read, stop; and the two-core plan.

Every server a bench measures runs as a child of the bench's process: the
sidecar and the simulators as ``python -m sidecar`` (so their pids are the
interpreters themselves and ``/proc/<pid>`` readings are theirs alone), the
reference hops and fakes as their own programs. Each child's affinity is set
in the child before exec, so every thread or process it later starts
inherits it. Each child gets its own session, as separate services would:
with the kernel's autogroup scheduling a session is one scheduling group
whose weight is split over the CPUs its tasks use, so a sidecar sharing the
load generator's session got a sliver of its own core and, beside other busy
processes, sat runnable for seconds. A child also dies with this process
(parent-death signal). Readiness is polled against a deadline, never slept
on a guess. ``peaks`` samples children's RSS (or open files) for its highest
reading while a phase runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TypeVar

import aiohttp

HOST = "127.0.0.1"


STOP_TIMEOUT = 10.0


# ``python -P -c FROM_CHECKOUT DIR serve ...``: the sidecar of another checkout (a worktree) in this
# environment, for a before-and-after in one run.
FROM_CHECKOUT = (
    "import runpy, sys; sys.path.insert(0, sys.argv.pop(1)); sys.argv[0] = 'sidecar'; "
    "runpy.run_module('sidecar', run_name='__main__')"
)


_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


_PR_SET_PDEATHSIG = 1


_Number = TypeVar("_Number", int, float)


class BenchError(Exception):
    """The benchmark itself broke (a server would not start, answers were wrong)."""


@dataclass(frozen=True, slots=True)
class CorePlan:
    """Which CPUs the load side (this process and D) and the sidecar run on."""

    load: frozenset[int]
    sidecar: frozenset[int]

    @property
    def pinned(self) -> bool:
        return not self.load & self.sidecar

    def describe(self, load: str = "load generator + D", sidecar: str = "sidecar") -> str:
        """Which CPUs ``load`` (what runs on the load core) and ``sidecar`` (on the other) got."""
        if not self.pinned:
            return f"not pinned: only CPUs {sorted(self.load)} available"
        return f"{load} on CPU {sorted(self.load)}, {sidecar} on CPU {sorted(self.sidecar)}"


def plan_cores() -> CorePlan:
    """The first available CPU for the load side, the second for the sidecar."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return CorePlan(frozenset(cpus), frozenset(cpus))
    return CorePlan(frozenset(cpus[:1]), frozenset(cpus[1:2]))


class Child:
    """One server process, its log file, and its ``/proc`` readings."""

    def __init__(self, name: str, argv: list[str], cpus: frozenset[int], log_dir: Path) -> None:
        self.name = name
        self._log_path = log_dir / f"{name}.log"
        self._log: IO[bytes] = self._log_path.open("wb")
        self.process = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            preexec_fn=child_setup(cpus),
            start_new_session=True,
        )

    @property
    def pid(self) -> int:
        return self.process.pid

    def cpu_seconds(self) -> float:
        """utime + stime of the whole process (all threads) and of its live descendants (nginx's
        worker), from ``/proc/<pid>/stat``."""
        return cpu_seconds(self.pid) + sum(_gone_is_0(cpu_seconds, pid) for pid in _descendants(self.pid))

    def rss_bytes(self) -> int:
        """VmRSS from ``/proc/<pid>/status``, with that of its live descendants added."""
        own = _rss_bytes(self.pid)
        if not own:
            raise BenchError(f"{self.name}: no VmRSS in /proc/{self.pid}/status")
        return own + sum(_gone_is_0(_rss_bytes, pid) for pid in _descendants(self.pid))

    def log_tail(self, lines: int = 20) -> str:
        self._log.flush()
        text = self._log_path.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    def stop(self) -> None:
        """SIGTERM, then SIGKILL to its whole process group if it has not exited within ``STOP_TIMEOUT``."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.pid, signal.SIGKILL)  # its own session: it and its descendants only
                self.process.wait()
        self._log.close()


def cpu_seconds(pid: int) -> float:
    """utime + stime of one whole process (all its threads), from ``/proc/<pid>/stat``."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2 :].split()  # the command name may contain spaces
    return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0  # a zombie has no VmRSS line


def _descendants(pid: int) -> list[int]:
    """Live descendants of ``pid``, from ``/proc/<pid>/task/<tid>/children``."""
    found: list[int] = []
    parents = [pid]
    while parents:
        parent = parents.pop()
        for children in Path(f"/proc/{parent}/task").glob("*/children"):
            with contextlib.suppress(OSError):  # the task or the process just went
                kids = [int(kid) for kid in children.read_text().split()]
                found += kids
                parents += kids
    return found


def _gone_is_0(read: Callable[[int], _Number], pid: int) -> _Number:
    """``read(pid)``, or 0 when that process has just exited."""
    try:
        return read(pid)
    except (FileNotFoundError, ProcessLookupError):
        return 0


def child_setup(cpus: frozenset[int]) -> Callable[[], None]:
    """Runs in the child between fork and exec: pin it, and have it die with us."""
    libc = ctypes.CDLL(None, use_errno=True)

    def setup() -> None:
        os.sched_setaffinity(0, cpus)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)

    return setup


def sidecar_argv(*args: str, checkout: Path | None = None) -> list[str]:
    """``python -m sidecar ARGS``, or the same of another checkout (``-P``: not this tree's package)."""
    if checkout is None:
        return [sys.executable, "-m", "sidecar", *args]
    return [sys.executable, "-P", "-c", FROM_CHECKOUT, str(checkout.resolve()), *args]


def serve_args(decode_url: str, port: int, admin: int) -> list[str]:
    """``serve`` as every measured sidecar runs: dry-run, quiet, quick to stop."""
    return [
        "serve", "--decode-url", decode_url, "--host", HOST, "--port", str(port),
        "--admin-host", HOST, "--admin-port", str(admin), "--release", "dry-run",
        "--log-level", "error", "--drain-timeout", "2", "--flush-timeout", "1",
    ]  # fmt: skip


Start = Callable[[str, list[str], frozenset[int]], Child]


@contextlib.contextmanager
def starting(prefix: str) -> Iterator[tuple[Path, Start]]:
    """A temporary log directory, and ``start(name, argv, cpus)``, which starts a ``Child`` logging
    into it; on exit every child stops (last started first), then the directory goes."""
    with tempfile.TemporaryDirectory(prefix=prefix) as logs, contextlib.ExitStack() as running:
        log_dir = Path(logs)

        def start(name: str, argv: list[str], cpus: frozenset[int]) -> Child:
            child = Child(name, argv, cpus, log_dir)
            running.callback(child.stop)
            return child

        yield log_dir, start


async def wait_all_ready(ready: Mapping[Child, str], deadline: float) -> None:
    """Poll each child's readiness URL, in order, until 200, or raise past ``deadline`` (monotonic)."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2.0)) as session:
        for child, url in ready.items():
            await _poll(session, child, url, deadline)


async def _poll(session: aiohttp.ClientSession, child: Child, url: str, deadline: float) -> None:
    while True:
        if child.process.poll() is not None:
            raise BenchError(f"{child.name} exited with {child.process.returncode}:\n{child.log_tail()}")
        with contextlib.suppress(aiohttp.ClientError, TimeoutError):
            async with session.get(url) as response:
                if response.status == 200:
                    return
        if time.monotonic() > deadline:
            raise BenchError(f"{child.name} not ready at {url} before the deadline:\n{child.log_tail()}")
        await asyncio.sleep(0.05)  # poll interval, not a readiness guess


SAMPLE_INTERVAL = 0.1  # seconds between two readings of the hop's RSS (and open files) during a phase


def rss_peak(proxy: Child | None) -> contextlib.AbstractAsyncContextManager[list[int]]:
    """The highest RSS of ``proxy`` read while the block runs (in a one-item list), 0 without a hop."""
    return peaks([] if proxy is None else [proxy], Child.rss_bytes)


@contextlib.asynccontextmanager
async def peaks(children: Sequence[Child], *reads: Callable[[Child], int]) -> AsyncIterator[list[int]]:
    """The highest sum over ``children`` of each of ``reads`` (RSS, open files), one item each: read
    every ``SAMPLE_INTERVAL`` seconds while the block runs and once more at its end; 0 without children."""
    peak = [0] * len(reads)

    def take() -> None:
        for i, read in enumerate(reads):
            peak[i] = max(peak[i], sum(read(child) for child in children))

    async def sample() -> None:
        while True:
            take()
            await asyncio.sleep(SAMPLE_INTERVAL)

    if not children:
        yield peak
        return
    task = asyncio.create_task(sample())
    try:
        yield peak
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        take()
