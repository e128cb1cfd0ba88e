"""One measured phase on one path, and each path's phases pooled over the rounds.

A phase is warmed up first by the Python load generator on fresh
connections (it checks every answer), then measured: the JSON phases by the
JSON load generator (wrk when installed, else the Python one) for a fixed
time, the SSE phase by the Python one for a fixed number of streams (wrk
cannot time the first event of a stream). Around the measured part only,
the hop's and D's CPU are read from ``/proc``, the other processes on the
benchmark's cores are snapshotted, and the hop's RSS is sampled for its
peak; the load generator reports its own CPU. ``Pooled`` sums all of it
over the rounds, so a path's figures come from every round alike.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Literal, Protocol

from bench.harness.load import Kind, LoadClient, Sample, check
from bench.harness.noise import Other, Snapshot, snapshot_of
from bench.harness.procs import Child, CorePlan, rss_peak
from bench.harness.report import MB
from bench.harness.stats import ms, percentile
from bench.paths.launch import PathName, Servers
from bench.paths.report import JsonFigures, ProxyCost, SseFigures
from bench.paths.saturation import PhaseLoad, phase_load
from bench.paths.settings import Settings

PhaseName = Literal["json_c1", "json_c32", "sse"]


@dataclass(frozen=True, slots=True)
class Phase:
    name: PhaseName
    kind: Kind
    concurrency: int
    count: int = 0  # SSE: streams per path and round
    seconds: float = 0.0  # JSON: seconds per path and round


class JsonLoad(Protocol):
    """What generates the JSON phases' load: wrk, or the Python load generator."""

    @property
    def external(self) -> bool:
        """A process of its own, whose CPU this process's own readings do not include."""
        ...

    def describe(self) -> str: ...

    async def run(
        self, base_url: str, connections: int, seconds: float, request_timeout: float
    ) -> Sample: ...


@dataclass(frozen=True, slots=True)
class PythonJson:
    """The Python load generator (aiohttp, in this process) for the JSON phases: the fallback."""

    max_tokens: int
    why: str
    external: bool = False

    def describe(self) -> str:
        return f"the Python load generator (aiohttp, in the bench's process): {self.why}"

    async def run(self, base_url: str, connections: int, seconds: float, request_timeout: float) -> Sample:
        async with LoadClient(base_url, connections, request_timeout, self.max_tokens) as client:
            return await client.run_for("json", seconds)


@dataclass(slots=True)
class Measured:
    """One measured phase on one path."""

    sample: Sample
    decode_cpu: float
    proxy_cpu: float
    rss_peak: int
    noise: tuple[Snapshot, Snapshot]


@dataclass(slots=True)
class Pooled:
    """One phase on one path, pooled over rounds."""

    requests: int = 0
    latencies: list[float] = field(default_factory=list)
    ttfbs: list[float] = field(default_factory=list)
    wall: float = 0.0  # as the load generator timed its runs
    client_cpu: float = 0.0
    decode_cpu: float = 0.0
    proxy_cpu: float = 0.0
    rss_peak: int = 0
    other: Other = field(default_factory=Other)

    def add(self, measured: Measured) -> None:
        self.requests += measured.sample.requests()
        self.latencies += measured.sample.latencies
        self.ttfbs += measured.sample.ttfbs
        self.wall += measured.sample.wall
        self.client_cpu += measured.sample.client_cpu
        self.decode_cpu += measured.decode_cpu
        self.proxy_cpu += measured.proxy_cpu
        self.rss_peak = max(self.rss_peak, measured.rss_peak)
        self.other.add(*measured.noise)

    def json(self) -> JsonFigures:
        return JsonFigures(
            requests=self.requests,
            seconds=self.wall,
            rps=self.requests / self.wall,
            p50_ms=ms(percentile(self.latencies, 50)),
            p99_ms=ms(percentile(self.latencies, 99)),
        )

    def sse(self) -> SseFigures:
        return SseFigures(
            streams=self.requests,
            ttfb_p50_ms=ms(percentile(self.ttfbs, 50)),
            ttfb_p99_ms=ms(percentile(self.ttfbs, 99)),
            total_p50_ms=ms(percentile(self.latencies, 50)),
            total_p99_ms=ms(percentile(self.latencies, 99)),
        )

    def cpu_ms_per_request(self) -> float:
        """The hop's CPU ms per request, which is also its CPU seconds per 1,000 requests."""
        return ms(self.proxy_cpu / self.requests)

    def load(self) -> PhaseLoad:
        return phase_load((self.client_cpu, self.decode_cpu, self.proxy_cpu), self.other.shares(), self.wall)


def proxy_cost(pooled: dict[PhaseName, Pooled], rss_idle: int) -> ProxyCost:
    """A hop's cost from its pooled phases; ``rss_idle``: its RSS before any load."""
    c32 = pooled["json_c32"]
    return ProxyCost(
        cpu_ms_per_request_json_c32=c32.cpu_ms_per_request(),
        core_rps_json_c32=c32.requests / c32.proxy_cpu if c32.proxy_cpu > 0 else 0.0,
        cpu_ms_per_request_json_c1=pooled["json_c1"].cpu_ms_per_request(),
        cpu_ms_per_sse_stream=pooled["sse"].cpu_ms_per_request(),
        rss_idle_mb=rss_idle / MB,
        rss_load_mb=c32.rss_peak / MB,
    )


def snapshot(plan: CorePlan, servers: Servers) -> Snapshot:
    ours_load = time.process_time() + servers.decode.cpu_seconds()
    return snapshot_of(plan, ours_load, sum(proxy.cpu_seconds() for proxy in servers.proxies()))


class Measurer:
    """Measures phases on the running servers: warm-up, then the measured part with its readings."""

    def __init__(self, settings: Settings, plan: CorePlan, servers: Servers, json_load: JsonLoad) -> None:
        self.settings, self._plan, self._servers, self._json = settings, plan, servers, json_load

    async def measure(self, phase: Phase, path: PathName, bound: float) -> Measured:
        """Warm up, then one measured phase; ``bound`` limits an SSE phase's time."""
        servers, settings = self._servers, self.settings
        everyone = (servers.decode, *servers.proxies())
        url, proxy = servers.url(path), servers.proxy(path)
        async with LoadClient(
            url, phase.concurrency, settings.request_timeout, settings.answer_tokens
        ) as client:
            warmup = max(settings.warmup_requests, phase.concurrency)
            check(
                await client.run(phase.kind, warmup, settings.warmup_bound),
                everyone,
                f"{phase.name} via {path}, warm-up",
            )
            before, decode, hop = snapshot(self._plan, servers), servers.decode.cpu_seconds(), _cpu(proxy)
            async with rss_peak(proxy) as peak:
                if phase.kind == "json":
                    sample = await self._json.run(
                        url, phase.concurrency, phase.seconds, settings.request_timeout
                    )
                else:
                    sample = await client.run(phase.kind, phase.count, bound)
            decode, hop = servers.decode.cpu_seconds() - decode, _cpu(proxy) - hop
            after = snapshot(self._plan, servers)
        if not stalled(sample):
            check(sample, everyone, f"{phase.name} via {path}, measured phase")
        if phase.kind == "json" and self._json.external:  # the client's CPU on the load core was ours too
            after = dataclasses.replace(after, load_ours=after.load_ours + sample.client_cpu)
        return Measured(sample, decode, hop, peak[0], (before, after))


def stalled(sample: Sample) -> bool:
    """A timed run in which no request completed and none failed: the machine stalled the path
    for the whole round (wrk does not count requests still in flight when its time is up)."""
    return sample.completed == 0 and not sample.errors


def _cpu(proxy: Child | None) -> float:
    return proxy.cpu_seconds() if proxy is not None else 0.0
