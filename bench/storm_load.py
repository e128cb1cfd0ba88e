"""The load sides of ``bench.bench_storm`` and the readings taken around its phases.

``NormalLoad`` is the traffic whose latency the storm may hurt: admitted chat
completions (no ``kv_transfer_params``, so nothing to release) through the
sidecar over a fixed number of closed-loop keep-alive connections, in this
process, until told to stop; every answer must be a 200. ``StormWorker``
drives the storm generator (``bench.storm_worker``), a child process of its
own on the load core. ``Scrape`` reads the sidecar's ``/metrics`` and P's
``/stats``; ``quantile`` estimates a percentile from a Prometheus histogram.
"""

from __future__ import annotations

import asyncio
import ctypes
import math
import os
import signal
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import aiohttp
import msgspec
from prometheus_client.parser import text_string_to_metric_families

from bench.noise import core_busy
from bench.procs import BenchError

ROUTE = "/v1/chat/completions"
_HEADERS = {"content-type": "application/json"}
_MAX_ERRORS_KEPT = 5
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
_PR_SET_PDEATHSIG = 1


def _session(connections: int, timeout: float) -> aiohttp.ClientSession:
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=connections, limit_per_host=connections),
        timeout=aiohttp.ClientTimeout(total=timeout),
        auto_decompress=False,
        trust_env=False,
        cookie_jar=aiohttp.DummyCookieJar(),
    )


@dataclass(slots=True)
class Timed:
    """The other requests of one phase: (start, seconds) of every answered one."""

    samples: list[tuple[float, float]] = field(default_factory=list)
    errors: int = 0
    first_errors: list[str] = field(default_factory=list)

    def fail(self, detail: str) -> None:
        self.errors += 1
        if len(self.first_errors) < _MAX_ERRORS_KEPT:
            self.first_errors.append(detail)

    def within(self, start: float, end: float) -> list[float]:
        """Latencies of the requests sent inside ``[start, end]`` (however long they took)."""
        return [seconds for at, seconds in self.samples if start <= at <= end]


class NormalLoad:
    """``connections`` closed loops of admitted JSON requests through the sidecar."""

    def __init__(self, sidecar_url: str, model: str, connections: int, request_timeout: float) -> None:
        self._url = sidecar_url + ROUTE
        self._connections = connections
        self._timeout = request_timeout
        self._body = msgspec.json.encode(
            {
                "model": model,
                "messages": [{"role": "user", "content": "Say hello to the benchmark."}],
                "max_tokens": 16,
            }
        )
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> NormalLoad:
        self._session = _session(self._connections, self._timeout)
        return self

    async def __aexit__(
        self, typ: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._session is not None:
            await self._session.close()

    async def run(self, stop: asyncio.Event) -> Timed:
        """Send over every connection until ``stop`` is set (each loop finishes its request)."""
        timed = Timed()
        await asyncio.gather(*(self._loop(stop, timed) for _ in range(self._connections)))
        return timed

    async def run_for(self, seconds: float) -> Timed:
        stop = asyncio.Event()
        asyncio.get_running_loop().call_later(seconds, stop.set)
        return await self.run(stop)

    async def _loop(self, stop: asyncio.Event, timed: Timed) -> None:
        assert self._session is not None
        while not stop.is_set():
            started = time.monotonic()
            try:
                async with self._session.post(self._url, data=self._body, headers=_HEADERS) as response:
                    body = await response.read()
            except (aiohttp.ClientError, TimeoutError) as exc:
                timed.fail(repr(exc))
                continue
            elapsed = time.monotonic() - started
            if response.status != 200:
                timed.fail(f"answered {response.status}: {body[:200]!r}")
                continue
            timed.samples.append((started, elapsed))


class StormWorker:
    """The storm generator child: prepares P's parameters, then storms the sidecar on command."""

    def __init__(
        self, prefill_url: str, sidecar_url: str, model: str, connections: int, log_dir: Path
    ) -> None:
        self._argv = [
            sys.executable,
            "-m",
            "bench.storm_worker",
            "--prefill-url",
            prefill_url,
            "--sidecar-url",
            sidecar_url,
            "--model",
            model,
            "--connections",
            str(connections),
        ]
        self._log_path = log_dir / "storm-worker.log"
        self._process: asyncio.subprocess.Process | None = None

    @property
    def pid(self) -> int:
        assert self._process is not None
        return self._process.pid

    async def __aenter__(self) -> StormWorker:
        with self._log_path.open("wb") as log:
            self._process = await asyncio.create_subprocess_exec(
                *self._argv,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=log,
                preexec_fn=_die_with_parent,
                start_new_session=True,  # its own scheduling group, like the servers
            )
        return self

    async def __aexit__(
        self, typ: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        process = self._process
        if process is None or process.returncode is not None:
            return
        try:
            assert process.stdin is not None
            process.stdin.write(b'{"cmd": "quit"}\n')
            await process.stdin.drain()
            await asyncio.wait_for(process.wait(), 5.0)
        except (OSError, TimeoutError):
            process.kill()
            await process.wait()

    async def send(self, command: Mapping[str, Any]) -> None:
        assert self._process is not None and self._process.stdin is not None
        self._process.stdin.write(msgspec.json.encode(command) + b"\n")
        await self._process.stdin.drain()

    async def receive(self, within: float) -> dict[str, Any]:
        """The worker's next answer; a dead or silent worker breaks the benchmark."""
        assert self._process is not None and self._process.stdout is not None
        try:
            line = await asyncio.wait_for(self._process.stdout.readline(), within)
        except TimeoutError:
            raise BenchError(f"storm worker silent for {within:.0f} s:\n{self.log_tail()}") from None
        if not line:
            raise BenchError(f"storm worker exited:\n{self.log_tail()}")
        answer: dict[str, Any] = msgspec.json.decode(line)
        if "error" in answer:
            raise BenchError(f"storm worker: {answer['error']}")
        return answer

    def log_tail(self, lines: int = 20) -> str:
        return "\n".join(self._log_path.read_text(errors="replace").splitlines()[-lines:])


def _die_with_parent() -> None:
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def cpu_seconds(pid: int) -> float:
    """utime + stime of a whole process, from ``/proc/<pid>/stat``."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS


Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


class Scrape:
    """HTTP readings of the sidecar's admin ``/metrics`` and P's ``/stats``."""

    def __init__(self, session: aiohttp.ClientSession, admin_url: str, prefill_url: str) -> None:
        self._session = session
        self._metrics_url = admin_url + "/metrics"
        self._stats_url = prefill_url + "/stats"

    async def metrics(self) -> Samples:
        async with self._session.get(self._metrics_url) as response:
            text = await response.text()
        if response.status != 200:
            raise BenchError(f"sidecar /metrics answered {response.status}")
        samples: Samples = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                samples[sample.name, frozenset(sample.labels.items())] = sample.value
        return samples

    async def prefill_stats(self) -> dict[str, Any]:
        async with self._session.get(self._stats_url) as response:
            stats: dict[str, Any] = await response.json()
        if response.status != 200:
            raise BenchError(f"P /stats answered {response.status}")
        return stats


def sample(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def delta(before: Samples, after: Samples, name: str, **labels: str) -> float:
    return sample(after, name, **labels) - sample(before, name, **labels)


def quantile(before: Samples, after: Samples, name: str, q: float, **labels: str) -> float:
    """The ``q`` (0-1) quantile of a histogram's observations between two scrapes, in its unit.

    Linear inside the bucket holding the rank, as Prometheus' ``histogram_quantile``;
    a rank in the ``+Inf`` bucket gives the largest finite bound. NaN with no observations.
    """
    bounds: list[tuple[float, float]] = []
    for (sample_name, label_set), value in after.items():
        found = dict(label_set)
        le = found.pop("le", None)
        if sample_name == name + "_bucket" and le is not None and found == labels:
            count = value - before.get((sample_name, label_set), 0.0)
            bounds.append((float(le), count))
    bounds.sort()
    if not bounds or bounds[-1][1] <= 0:
        return math.nan
    rank = q * bounds[-1][1]
    low, below = 0.0, 0.0
    for bound, cumulative in bounds:
        if cumulative >= rank:
            if math.isinf(bound):
                return low
            share = (rank - below) / (cumulative - below) if cumulative > below else 1.0
            return low + (bound - low) * share
        low, below = bound, cumulative
    return low


@dataclass(frozen=True, slots=True)
class CpuReading:
    """Busy seconds of both benchmark cores, and what of it was the benchmark's own processes."""

    at: float
    load_busy: float
    sidecar_busy: float
    load_ours: float
    sidecar_ours: float
    sidecar_process: float  # the sidecar's own CPU seconds, wherever it ran


def cpu_reading(
    load_cpus: frozenset[int], sidecar_cpus: frozenset[int], load_pids: list[int], sidecar_pid: int
) -> CpuReading:
    busy = core_busy()
    ours_load = time.process_time() + sum(cpu_seconds(pid) for pid in load_pids)
    ours_sidecar = cpu_seconds(sidecar_pid)
    load = sum(busy.get(cpu, 0.0) for cpu in load_cpus)
    if load_cpus & sidecar_cpus:  # not pinned: count everything on the load side
        return CpuReading(time.monotonic(), load, 0.0, ours_load + ours_sidecar, 0.0, ours_sidecar)
    sidecar = sum(busy.get(cpu, 0.0) for cpu in sidecar_cpus)
    return CpuReading(time.monotonic(), load, sidecar, ours_load, ours_sidecar, ours_sidecar)


def other_cpu(before: CpuReading, after: CpuReading) -> tuple[float, float]:
    """Cores' worth of other processes' CPU on the load core and on the sidecar core."""
    wall = after.at - before.at
    if wall <= 0:
        return 0.0, 0.0
    load = (after.load_busy - before.load_busy) - (after.load_ours - before.load_ours)
    sidecar = (after.sidecar_busy - before.sidecar_busy) - (after.sidecar_ours - before.sidecar_ours)
    return max(0.0, load) / wall, max(0.0, sidecar) / wall
