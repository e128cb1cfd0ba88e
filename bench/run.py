"""One run: start and pin the servers, then every phase on every path, round after round.

The paths: direct to D, through the sidecar, and through the reference hops
on the sidecar's core (the relay always, nginx when its binary is available).
Phases run in a fixed order (JSON at 1 connection, JSON at 32, SSE). Each is
measured in several short rounds, every round on every path; round ``r``
takes the paths in their base order rotated to start at path ``r mod N``, and
the number of rounds is a multiple of ``N``, so each path takes each position
equally often and drift or a burst of noise hits all paths alike. Each path's
samples are pooled over the rounds. Every measured phase is preceded by its
own warm-up on a fresh client. Each proxy's CPU, and other processes' CPU on
the benchmark's cores, are read from ``/proc`` just around the measured
phases, so warm-ups and readiness checks are not counted.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import msgspec

from bench.load import Kind, LoadClient, Sample
from bench.noise import Other, Snapshot, snapshot
from bench.procs import CorePlan, PathName, Servers, check, launched, wait_ready
from bench.report import (
    JsonFigures,
    OtherCpu,
    PathFigures,
    ProxyCost,
    Report,
    SseFigures,
    environment,
    over,
    ratios,
    targets,
)
from bench.settings import Settings
from bench.stats import ms, percentile

PhaseName = Literal["json_c1", "json_c32", "sse"]
Progress = Callable[[str], None]


@dataclass(frozen=True, slots=True)
class Phase:
    name: PhaseName
    kind: Kind
    concurrency: int
    count: int  # per path and round


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

    def __init__(self, settings: Settings, phases: int, paths: int) -> None:
        self._end = time.monotonic() + settings.run_budget * paths
        self._cap = settings.phase_bound
        self._left = phases

    def next(self) -> float:
        share = (self._end - time.monotonic()) / max(1, self._left)
        self._left -= 1
        return max(1.0, min(self._cap, share))


def phases(settings: Settings, rounds: int) -> list[Phase]:
    """The phases, each with its count per path and round (the settings' counts split over ``rounds``)."""

    def per_round(total: int) -> int:
        return math.ceil(total / rounds)

    return [
        Phase("json_c1", "json", 1, per_round(settings.json_c1_requests)),
        Phase("json_c32", "json", 32, per_round(settings.json_c32_requests)),
        Phase("sse", "sse", settings.sse_concurrency, per_round(settings.sse_streams)),
    ]


def order(paths: Sequence[PathName], round_: int) -> list[PathName]:
    """Round ``round_``'s order (0-based): ``paths`` rotated to start at ``round_ mod len(paths)``."""
    start = round_ % len(paths)
    return [*paths[start:], *paths[:start]]


@dataclass(slots=True)
class _Results:
    """Everything the measured phases produced, pooled per phase and path."""

    pooled: dict[tuple[PhaseName, PathName], _Pooled]
    other: dict[PathName, Other]
    stopped_early: list[str] = field(default_factory=list)


async def run(
    settings: Settings, plan: CorePlan, quick: bool, progress: Progress, nginx: str | None = None
) -> Report:
    """Start the servers, measure every phase on every path, and build the report."""
    started, loadavg_start = time.monotonic(), os.getloadavg()[0]
    with launched(plan, settings.stream_events, nginx) as servers:
        await wait_ready(servers, started + settings.ready_timeout)
        pids = ", ".join(f"{child.name} pid {child.pid}" for child in (servers.decode, *servers.proxies()))
        progress(f"ready: {pids}; {plan.describe()}")
        paths = servers.paths()
        rounds = settings.rounds_for(len(paths))
        results = await _measure_all(settings, plan, servers, rounds, progress)
        rss = {path: proxy.rss_bytes() for path in paths if (proxy := servers.proxy(path)) is not None}
    figures = {path: _figures(results.pooled, path) for path in paths}
    cost = _cost(results.pooled, "sidecar", rss["sidecar"])
    ratio = ratios(figures["direct"], figures["sidecar"])
    references: list[PathName] = [path for path in paths if path in ("relay", "nginx")]
    return Report(
        quick=quick,
        cores=plan.describe(),
        settings=msgspec.structs.asdict(settings),
        rounds=rounds,
        paths=list(paths),
        seconds=time.monotonic() - started,
        direct=figures["direct"],
        sidecar=figures["sidecar"],
        cost=cost,
        ratios=ratio,
        targets=targets(ratio, cost),
        environment=environment(
            (loadavg_start, os.getloadavg()[0]),
            {path: _other_cpu(other) for path, other in results.other.items()},
        ),
        stopped_early=results.stopped_early,
        relay=figures["relay"],
        nginx=figures.get("nginx"),
        reference_ratios={path: ratios(figures["direct"], figures[path]) for path in references},
        reference_cost={path: _cost(results.pooled, path, rss[path]) for path in references},
        sidecar_over_reference={path: over(figures["sidecar"], figures[path]) for path in references},
    )


async def _measure_all(
    settings: Settings, plan: CorePlan, servers: Servers, rounds: int, progress: Progress
) -> _Results:
    """Every phase, ``rounds`` times on every path, the order rotating from round to round."""
    paths = servers.paths()
    results = _Results(
        {(phase.name, path): _Pooled() for phase in phases(settings, rounds) for path in paths},
        {path: Other() for path in paths},
    )
    budget = _Budget(settings, len(phases(settings, rounds)) * rounds * len(paths), len(paths))
    for phase in phases(settings, rounds):
        for round_ in range(rounds):
            for path in order(paths, round_):
                sample, cpu, noise = await _measure(settings, plan, servers, phase, path, budget.next())
                results.pooled[phase.name, path].add(sample, cpu)
                results.other[path].add(*noise)
                if sample.bounded:
                    results.stopped_early.append(f"{phase.name} {path} round {round_ + 1}")
                progress(_line(phase, round_, path, sample, noise))
    return results


def _cost(pooled: dict[tuple[PhaseName, PathName], _Pooled], path: PathName, rss: int) -> ProxyCost:
    return ProxyCost(
        cpu_s_per_1k_json_c32=pooled["json_c32", path].cpu_per_1k(),
        cpu_s_per_1k_json_c1=pooled["json_c1", path].cpu_per_1k(),
        cpu_ms_per_sse_stream=pooled["sse", path].cpu_per_1k(),  # s per 1,000 = ms per one
        rss_mib=rss / 2**20,
    )


async def _measure(
    settings: Settings, plan: CorePlan, servers: Servers, phase: Phase, path: PathName, bound: float
) -> tuple[Sample, float, tuple[Snapshot, Snapshot]]:
    """Warm up, then one measured phase: the sample, the path's proxy CPU seconds, noise snapshots."""
    proxy = servers.proxy(path)
    everyone = (servers.decode, *servers.proxies())
    async with LoadClient(servers.url(path), phase.concurrency, settings.request_timeout) as client:
        warmup = max(settings.warmup_requests, phase.concurrency)
        warm = await client.run(phase.kind, warmup, settings.warmup_bound)
        check(warm, everyone, f"{phase.name} via {path}, warm-up")
        before = snapshot(plan, servers)
        cpu = proxy.cpu_seconds() if proxy else 0.0
        sample = await client.run(phase.kind, phase.count, bound)
        cpu = (proxy.cpu_seconds() - cpu) if proxy else 0.0
        after = snapshot(plan, servers)
    check(sample, everyone, f"{phase.name} via {path}, measured phase")
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
