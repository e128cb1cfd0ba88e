"""The two servers under test as child processes: start, pin, wait until ready, read, stop.

D (``sim-decode``) and the sidecar (``serve``) run as ``python -m sidecar``
children of this process, so their pids are the interpreters themselves and
``/proc/<pid>`` readings are theirs alone. Each child's affinity is set in
the child before exec, so every thread it later starts inherits it. Each
child gets its own session, as separate services would: with the kernel's
autogroup scheduling a session is one scheduling group whose weight is split
over the CPUs its tasks use, so a sidecar sharing the load generator's
session got a sliver of its own core and, beside other busy processes, sat
runnable for seconds. A child also dies with this process (parent-death
signal). Readiness is polled against a deadline (D's ``GET /health``, the
sidecar's ``GET /readyz`` on the admin port), never slept on a guess.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Protocol

import aiohttp

HOST = "127.0.0.1"
STOP_TIMEOUT = 10.0
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
_PR_SET_PDEATHSIG = 1


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

    def describe(self) -> str:
        if not self.pinned:
            return f"not pinned: only CPUs {sorted(self.load)} available"
        return f"load generator + D on CPU {sorted(self.load)}, sidecar on CPU {sorted(self.sidecar)}"


def plan_cores() -> CorePlan:
    """The first available CPU for the load side, the second for the sidecar."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return CorePlan(frozenset(cpus), frozenset(cpus))
    return CorePlan(frozenset(cpus[:1]), frozenset(cpus[1:2]))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


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
            preexec_fn=_child_setup(cpus),
            start_new_session=True,
        )

    @property
    def pid(self) -> int:
        return self.process.pid

    def cpu_seconds(self) -> float:
        """utime + stime of the whole process (all threads), from ``/proc/<pid>/stat``."""
        stat = Path(f"/proc/{self.pid}/stat").read_text()
        fields = stat[stat.rindex(")") + 2 :].split()  # the command name may contain spaces
        return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS

    def rss_bytes(self) -> int:
        """VmRSS from ``/proc/<pid>/status``."""
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise BenchError(f"{self.name}: no VmRSS in /proc/{self.pid}/status")

    def log_tail(self, lines: int = 20) -> str:
        self._log.flush()
        text = self._log_path.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    def stop(self) -> None:
        """SIGTERM, then SIGKILL if it has not exited within ``STOP_TIMEOUT``."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()


def _child_setup(cpus: frozenset[int]) -> Callable[[], None]:
    """Runs in the child between fork and exec: pin it, and have it die with us."""
    libc = ctypes.CDLL(None, use_errno=True)

    def setup() -> None:
        os.sched_setaffinity(0, cpus)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)

    return setup


def _sidecar_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "sidecar", *args]


@dataclass(frozen=True, slots=True)
class Servers:
    """D and the sidecar as started (``wait_ready`` tells when both answer)."""

    decode: Child
    sidecar: Child
    decode_url: str
    sidecar_url: str
    admin_url: str


@contextlib.contextmanager
def launched(plan: CorePlan, stream_events: int) -> Iterator[Servers]:
    """Start D and the sidecar (not yet known ready); stop both on exit."""
    d_port, s_port, a_port = free_port(), free_port(), free_port()
    decode_url, sidecar_url = f"http://{HOST}:{d_port}", f"http://{HOST}:{s_port}"
    with tempfile.TemporaryDirectory(prefix="kvr-bench-") as logs:
        log_dir = Path(logs)
        decode = Child(
            "sim-decode",
            _sidecar_argv(
                "sim-decode", "--host", HOST, "--port", str(d_port), "--stream-events", str(stream_events)
            ),
            plan.load,
            log_dir,
        )
        try:
            sidecar = Child(
                "sidecar",
                _sidecar_argv(
                    "serve",
                    "--decode-url", decode_url,
                    "--host", HOST,
                    "--port", str(s_port),
                    "--admin-host", HOST,
                    "--admin-port", str(a_port),
                    "--release", "dry-run",
                    "--log-level", "error",
                    "--drain-timeout", "2",
                    "--flush-timeout", "1",
                ),
                plan.sidecar,
                log_dir,
            )  # fmt: skip
        except BaseException:
            decode.stop()
            raise
        try:
            yield Servers(decode, sidecar, decode_url, sidecar_url, f"http://{HOST}:{a_port}")
        finally:
            sidecar.stop()
            decode.stop()


async def wait_ready(servers: Servers, deadline: float) -> None:
    """Poll D's ``/health`` then the sidecar's ``/readyz`` until 200 or ``deadline`` (monotonic)."""
    await wait_all_ready(
        {servers.decode: servers.decode_url + "/health", servers.sidecar: servers.admin_url + "/readyz"},
        deadline,
    )


async def wait_all_ready(ready: Mapping[Child, str], deadline: float) -> None:
    """Poll each child's readiness URL, in order, until 200, or raise past ``deadline`` (monotonic)."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2.0)) as session:
        for child, url in ready.items():
            await _poll(session, child, url, deadline)


class Measured(Protocol):
    """What ``check`` reads of a phase's sample (``bench.load.Sample`` and the router bench's)."""

    latencies: list[float]
    errors: int
    first_errors: list[str]


def check(sample: Measured, children: Iterable[Child], what: str) -> None:
    """Wrong answers break a benchmark: raise saying ``what`` failed, with the servers' last log lines."""
    if sample.errors:
        problem = f"{sample.errors} failed request(s); first: {sample.first_errors}"
    elif not sample.latencies:
        problem = "no request completed"
    else:
        return
    logs = "\n".join(f"--- {c.name} log:\n{c.log_tail()}" for c in children)
    raise BenchError(f"{what}: {problem}\n{logs}")


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
