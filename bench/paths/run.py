"""One run: start and pin the servers, then every phase on every path, round after round.

The paths: direct to D, through the sidecar, and through the reference hops
on the sidecar's core (the relay always, nginx when its binary is available).
Phases run in a fixed order (JSON at 32 connections, JSON at 1, SSE). Each
is measured in several short rounds, every round on every path; round ``r``
takes the paths in their base order rotated to start at path ``r mod N``, and
the number of rounds is a multiple of ``N``, so each path takes each position
equally often and drift or a burst of noise hits all paths alike. Each path's
samples are pooled over the rounds (``bench.paths.measure``). Each hop's RSS is
read once every server is ready, before any load: its idle RSS.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from bench.harness.noise import Other
from bench.harness.procs import BenchError, CorePlan
from bench.harness.report import environment, other_cpu
from bench.harness.rounds import order
from bench.harness.stats import ms, percentile
from bench.paths.launch import PathName, Servers, launched, wait_ready
from bench.paths.measure import JsonLoad, Measured, Measurer, Phase, PhaseName, Pooled, proxy_cost, stalled
from bench.paths.report import PathFigures, PathReport, Report, client_saturated, path_report, targets
from bench.paths.saturation import PhaseLoad
from bench.paths.settings import Settings

Progress = Callable[[str], None]


class _Budget:
    """Time bounds of the SSE phases: each gets an even share of what is left, counted from the first."""

    def __init__(self, settings: Settings, phases: int, paths: int) -> None:
        self._total = settings.run_budget * paths
        self._end: float | None = None
        self._cap = settings.phase_bound
        self._left = phases

    def next(self) -> float:
        if self._end is None:
            self._end = time.monotonic() + self._total
        share = (self._end - time.monotonic()) / max(1, self._left)
        self._left -= 1
        return max(1.0, min(self._cap, share))


def phases(settings: Settings, rounds: int) -> list[Phase]:
    """The phases, each with its time or count per path and round (the settings' totals over ``rounds``)."""
    return [
        Phase("json_c32", "json", 32, seconds=settings.json_c32_seconds / rounds),
        Phase("json_c1", "json", 1, seconds=settings.json_c1_seconds / rounds),
        Phase("sse", "sse", settings.sse_concurrency, count=math.ceil(settings.sse_streams / rounds)),
    ]


@dataclass(slots=True)
class _Results:
    """Everything the measured phases produced, pooled per path and phase."""

    pooled: dict[PathName, dict[PhaseName, Pooled]]
    other: dict[PathName, Other]
    stopped_early: list[str] = field(default_factory=list)


async def run(
    settings: Settings,
    plan: CorePlan,
    quick: bool,
    progress: Progress,
    json_load: JsonLoad,
    nginx: str | None = None,
    baseline: Path | None = None,
) -> Report:
    """Start the servers, measure every phase on every path, and build the report."""
    started, loadavg_start = time.monotonic(), os.getloadavg()[0]
    with launched(plan, settings.answer_tokens, nginx, baseline) as servers:
        await wait_ready(servers, started + settings.ready_timeout)
        idle = {path: hop.rss_bytes() for path in servers.paths() if (hop := servers.proxy(path)) is not None}
        pids = ", ".join(f"{child.name} pid {child.pid}" for child in (servers.decode, *servers.proxies()))
        progress(f"ready: {pids}; {plan.describe()}")
        progress(f"JSON load generator: {json_load.describe()}")
        rounds = settings.rounds_for(len(servers.paths()))
        results = await _measure_all(Measurer(settings, plan, servers, json_load), servers, rounds, progress)
    paths = list(results.pooled)
    figures = {path: _figures(results.pooled[path]) for path in paths}
    reports: dict[str, PathReport] = {}
    for path in paths:
        pooled = results.pooled[path]
        cost = proxy_cost(pooled, idle[path]) if path in idle else None
        load: dict[str, PhaseLoad] = {name: phase.load() for name, phase in pooled.items()}
        reports[path] = path_report(figures[path], figures["direct"], cost, load)
    return Report(
        quick=quick,
        cores=plan.describe(),
        json_client=json_load.describe(),
        json_client_is_wrk=json_load.external,
        settings=msgspec.structs.asdict(settings),
        rounds=rounds,
        paths=list(paths),
        seconds=time.monotonic() - started,
        results=reports,
        targets=targets(reports),
        client_saturated=client_saturated(reports),
        environment=environment(
            (loadavg_start, os.getloadavg()[0]),
            {path: other_cpu(other) for path, other in results.other.items()},
        ),
        stopped_early=results.stopped_early,
    )


async def _measure_all(measurer: Measurer, servers: Servers, rounds: int, progress: Progress) -> _Results:
    """Every phase, ``rounds`` times on every path, the order rotating from round to round."""
    paths = servers.paths()
    settings = measurer.settings
    every = phases(settings, rounds)
    results = _Results(
        {path: {phase.name: Pooled() for phase in every} for path in paths}, {path: Other() for path in paths}
    )
    budget = _Budget(
        settings, sum(1 for phase in every if phase.kind == "sse") * rounds * len(paths), len(paths)
    )
    for phase in every:
        for round_ in range(rounds):
            for path in order(paths, round_):
                bound = budget.next() if phase.kind == "sse" else 0.0
                measured = await measurer.measure(phase, path, bound)
                results.pooled[path][phase.name].add(measured)
                results.other[path].add(*measured.noise)
                if measured.sample.bounded:
                    results.stopped_early.append(f"{phase.name} {path} round {round_ + 1}")
                if stalled(measured.sample):
                    results.stopped_early.append(
                        f"{phase.name} {path} round {round_ + 1} (no request completed)"
                    )
                progress(_line(phase, round_, path, measured))
    for path, pooled in results.pooled.items():
        for name, phase_pooled in pooled.items():
            if not phase_pooled.requests:
                raise BenchError(f"{name} via {path}: no request completed in any round")
    return results


def _figures(pooled: dict[PhaseName, Pooled]) -> PathFigures:
    return PathFigures(
        json_c1=pooled["json_c1"].json(), json_c32=pooled["json_c32"].json(), sse=pooled["sse"].sse()
    )


def _line(phase: Phase, round_: int, path: PathName, measured: Measured) -> str:
    sample = measured.sample
    done = sample.requests()
    if not sample.latencies:
        return f"{phase.name:<8} round {round_ + 1} {path:<7} no request completed in {sample.wall:.1f} s"
    bounded = " (stopped early by its time bound)" if sample.bounded else ""
    pooled = Pooled()
    pooled.add(measured)
    cpu = pooled.load()
    return (
        f"{phase.name:<8} round {round_ + 1} {path:<7} {done:>6} in {sample.wall:5.1f} s"
        f"  {done / sample.wall:8.0f}/s  p50 {ms(percentile(sample.latencies, 50)):6.2f} ms"
        f"  CPU client/D/hop {cpu.client:.2f}/{cpu.decode:.2f}/{cpu.proxy:.2f}"
        f" other {cpu.other_load:.2f}/{cpu.other_hop:.2f} saturated: {cpu.bound}{bounded}"
    )
