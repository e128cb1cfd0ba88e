"""One run: start and pin both servers, then every phase on both paths, back to back.

Phases run in a fixed order (JSON at 1 connection, JSON at 32, SSE). Each is
measured ``rounds`` times per path; even rounds go direct then sidecar, odd
rounds the other way round (ABBA), and each path's samples are pooled over
the rounds. Every measured phase is preceded by its own warm-up on a fresh
client. The sidecar's CPU, and other processes' CPU on the benchmark's
cores, are read from ``/proc`` just around the measured phases, so warm-ups
and readiness checks are not counted.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import msgspec

from bench.load import Kind, LoadClient, Sample
from bench.noise import Other, Snapshot, snapshot
from bench.procs import CorePlan, Servers, check, launched, wait_ready
from bench.report import (
    JsonFigures,
    OtherCpu,
    PathFigures,
    Report,
    SidecarCost,
    SseFigures,
    environment,
    ratios,
    targets,
)
from bench.settings import Settings
from bench.stats import ms, percentile

PathName = Literal["direct", "sidecar"]
PhaseName = Literal["json_c1", "json_c32", "sse"]
Progress = Callable[[str], None]
PATHS: tuple[PathName, PathName] = ("direct", "sidecar")
_ORDERS: tuple[tuple[PathName, PathName], ...] = (("direct", "sidecar"), ("sidecar", "direct"))


@dataclass(frozen=True, slots=True)
class Phase:
    name: PhaseName
    kind: Kind
    concurrency: int
    count: int


@dataclass(slots=True)
class _Pooled:
    """One phase on one path, pooled over rounds."""

    latencies: list[float] = field(default_factory=list)
    ttfbs: list[float] = field(default_factory=list)
    wall: float = 0.0
    cpu: float = 0.0

    def add(self, sample: Sample, cpu: float) -> None:
        self.latencies += sample.latencies
        self.ttfbs += sample.ttfbs
        self.wall += sample.wall
        self.cpu += cpu

    def json(self) -> JsonFigures:
        count = len(self.latencies)
        return JsonFigures(
            requests=count,
            rps=count / self.wall,
            p50_ms=ms(percentile(self.latencies, 50)),
            p99_ms=ms(percentile(self.latencies, 99)),
        )

    def sse(self) -> SseFigures:
        return SseFigures(
            streams=len(self.latencies),
            ttfb_p50_ms=ms(percentile(self.ttfbs, 50)),
            ttfb_p99_ms=ms(percentile(self.ttfbs, 99)),
            total_p50_ms=ms(percentile(self.latencies, 50)),
            total_p99_ms=ms(percentile(self.latencies, 99)),
        )

    def cpu_per_1k(self) -> float:
        return self.cpu / len(self.latencies) * 1000


class _Budget:
    """Time bounds of the measured phases: each gets an even share of what is left."""

    def __init__(self, settings: Settings, phases: int) -> None:
        self._end = time.monotonic() + settings.run_budget
        self._cap = settings.phase_bound
        self._left = phases

    def next(self) -> float:
        share = (self._end - time.monotonic()) / max(1, self._left)
        self._left -= 1
        return max(1.0, min(self._cap, share))


def phases(settings: Settings) -> list[Phase]:
    return [
        Phase("json_c1", "json", 1, settings.json_c1_requests),
        Phase("json_c32", "json", 32, settings.json_c32_requests),
        Phase("sse", "sse", settings.sse_concurrency, settings.sse_streams),
    ]


@dataclass(slots=True)
class _Results:
    """Everything the measured phases produced, pooled per phase and path."""

    pooled: dict[tuple[PhaseName, PathName], _Pooled]
    other: dict[PathName, Other] = field(default_factory=lambda: {path: Other() for path in PATHS})
    stopped_early: list[str] = field(default_factory=list)


async def run(settings: Settings, plan: CorePlan, quick: bool, progress: Progress) -> Report:
    """Start the servers, measure every phase on both paths, and build the report."""
    started, loadavg_start = time.monotonic(), os.getloadavg()[0]
    with launched(plan, settings.stream_events) as servers:
        await wait_ready(servers, started + settings.ready_timeout)
        progress(f"ready: D pid {servers.decode.pid}, sidecar pid {servers.sidecar.pid}; {plan.describe()}")
        results = await _measure_all(settings, plan, servers, progress)
        rss = servers.sidecar.rss_bytes()
    direct, sidecar = (_figures(results.pooled, path) for path in PATHS)
    cost = _cost(results.pooled, rss)
    ratio = ratios(direct, sidecar)
    return Report(
        quick=quick,
        cores=plan.describe(),
        settings=msgspec.structs.asdict(settings),
        seconds=time.monotonic() - started,
        direct=direct,
        sidecar=sidecar,
        cost=cost,
        ratios=ratio,
        targets=targets(ratio, cost),
        environment=environment(
            (loadavg_start, os.getloadavg()[0]),
            _other_cpu(results.other["direct"]),
            _other_cpu(results.other["sidecar"]),
        ),
        stopped_early=results.stopped_early,
    )


async def _measure_all(settings: Settings, plan: CorePlan, servers: Servers, progress: Progress) -> _Results:
    """Every phase, ``rounds`` times per path, in ABBA order."""
    results = _Results({(phase.name, path): _Pooled() for phase in phases(settings) for path in PATHS})
    budget = _Budget(settings, len(phases(settings)) * settings.rounds * len(PATHS))
    for phase in phases(settings):
        for round_ in range(settings.rounds):
            for path in _ORDERS[round_ % 2]:
                sample, cpu, noise = await _measure(settings, plan, servers, phase, path, budget.next())
                results.pooled[phase.name, path].add(sample, cpu)
                results.other[path].add(*noise)
                if sample.bounded:
                    results.stopped_early.append(f"{phase.name} {path} round {round_ + 1}")
                progress(_line(phase, round_, path, sample, noise))
    return results


def _cost(pooled: dict[tuple[PhaseName, PathName], _Pooled], rss: int) -> SidecarCost:
    return SidecarCost(
        cpu_s_per_1k_json_c32=pooled["json_c32", "sidecar"].cpu_per_1k(),
        cpu_s_per_1k_json_c1=pooled["json_c1", "sidecar"].cpu_per_1k(),
        cpu_ms_per_sse_stream=pooled["sse", "sidecar"].cpu_per_1k(),  # s per 1,000 = ms per one
        rss_mib=rss / 2**20,
    )


async def _measure(
    settings: Settings, plan: CorePlan, servers: Servers, phase: Phase, path: PathName, bound: float
) -> tuple[Sample, float, tuple[Snapshot, Snapshot]]:
    """Warm up, then one measured phase: the sample, the sidecar's CPU seconds, noise snapshots."""
    url = servers.decode_url if path == "direct" else servers.sidecar_url
    async with LoadClient(url, phase.concurrency, settings.request_timeout) as client:
        warmup = max(settings.warmup_requests, phase.concurrency)
        warm = await client.run(phase.kind, warmup, settings.warmup_bound)
        check(warm, (servers.decode, servers.sidecar), f"{phase.name} via {path}, warm-up")
        before = snapshot(plan, servers)
        cpu = servers.sidecar.cpu_seconds()
        sample = await client.run(phase.kind, phase.count, bound)
        cpu = servers.sidecar.cpu_seconds() - cpu
        after = snapshot(plan, servers)
    check(sample, (servers.decode, servers.sidecar), f"{phase.name} via {path}, measured phase")
    return sample, cpu, (before, after)


def _figures(pooled: dict[tuple[PhaseName, PathName], _Pooled], path: PathName) -> PathFigures:
    return PathFigures(
        json_c1=pooled["json_c1", path].json(),
        json_c32=pooled["json_c32", path].json(),
        sse=pooled["sse", path].sse(),
    )


def _other_cpu(other: Other) -> OtherCpu:
    load, sidecar = other.shares()
    return OtherCpu(load_core=load, sidecar_core=sidecar)


def _line(
    phase: Phase,
    round_: int,
    path: PathName,
    sample: Sample,
    noise: tuple[Snapshot, Snapshot],
) -> str:
    done = len(sample.latencies)
    bounded = " (stopped early by its time bound)" if sample.bounded else ""
    other = Other()
    other.add(*noise)
    load, sidecar = other.shares()
    return (
        f"{phase.name:<8} round {round_ + 1} {path:<7} {done:>6} in {sample.wall:5.1f} s"
        f"  {done / sample.wall:8.0f}/s  p50 {ms(percentile(sample.latencies, 50)):6.2f} ms"
        f"  other CPU {load:.2f}/{sidecar:.2f}{bounded}"
    )
