"""Rounds: every path once a round, in an order that rotates; and phases of a fixed count of requests.

``order`` rotates the paths' base order to start at path ``r mod N`` in round
``r``, so each path takes each position equally often over ``N`` rounds and
drift or a burst of noise hits all paths alike. ``counted_rounds`` is that
rotation for the benches whose phases send a count of requests
(``bench.router``, ``bench.tracing``): every path at every number of connections, in rounds,
each phase warmed up and given an even share of the time left
(``CountedPhase``), the figures pooled per path and number of connections
(``Tally``); ``render_counted`` prints them.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from bench.harness.load import Sample, check
from bench.harness.procs import BenchError, Child, wait_all_ready
from bench.harness.settings import CountedSettings
from bench.harness.stats import ms, percentile

Progress = Callable[[str], None]
_Path = TypeVar("_Path")
_Name = TypeVar("_Name", bound=str)


def order(paths: Sequence[_Path], round_: int) -> list[_Path]:
    """Round ``round_``'s order (0-based): ``paths`` rotated to start at ``round_ mod len(paths)``."""
    start = round_ % len(paths)
    return [*paths[start:], *paths[:start]]


@dataclass(frozen=True, slots=True)
class CountedPhase:
    """One path at one number of connections in one round: ``warmup`` requests, then ``count``."""

    connections: int
    count: int
    warmup: int
    bound: float  # seconds for both

    async def warm_then_measure(
        self,
        send: Callable[[int, float], Awaitable[Sample]],
        children: Iterable[Child],
        what: str,
        hop: Child | None = None,
    ) -> tuple[Sample, float]:
        """Warm up (a quarter of the bound, 2 s at most), then measure in what is left, every answer
        checked; ``send(count, bound)`` sends them. Returns the measured sample and ``hop``'s CPU
        seconds during it (0 without one)."""
        what = f"{what} at {self.connections} connection(s)"
        warm = await send(self.warmup, min(self.bound / 4, 2.0))
        check(warm, children, f"{what}, warm-up")
        cpu = hop.cpu_seconds() if hop else 0.0
        sample = await send(self.count, self.bound - warm.wall)
        cpu = hop.cpu_seconds() - cpu if hop else 0.0
        check(sample, children, f"{what}, measured phase")
        return sample, cpu


@dataclass(slots=True)
class Tally:
    """One path at one number of connections, pooled over the rounds."""

    latencies: list[float] = field(default_factory=list)
    wall: float = 0.0
    cpu: float = 0.0  # the hop's CPU seconds; 0 where none was read

    def figures(self, p99: bool) -> dict[str, float]:
        if not self.latencies or self.wall <= 0:
            raise BenchError("a phase completed no request")
        figures = {
            "requests": len(self.latencies),
            "rps": len(self.latencies) / self.wall,
            "p50_ms": ms(percentile(self.latencies, 50)),
        }
        if p99:
            figures["p99_ms"] = ms(percentile(self.latencies, 99))
        if self.cpu:
            figures["cpu_s_per_1k"] = self.cpu / len(self.latencies) * 1000
        return figures


@dataclass(slots=True)
class Counted(Generic[_Name]):
    """What ``counted_rounds`` measured: a tally per (connections, path), and the phases stopped early."""

    tallies: dict[tuple[int, _Name], Tally]
    end: float  # the end of the measured phases' time (monotonic); shutdown has what is left after it
    stopped_early: list[str] = field(default_factory=list)

    def figures(self, path: _Name, p99: bool = True) -> dict[str, dict[str, float]]:
        """``path``'s figures by ``c<connections>``: requests, req/s, p50 (and p99) ms, CPU s per 1,000."""
        return {f"c{c}": tally.figures(p99) for (c, name), tally in self.tallies.items() if name == path}

    def completed(self, path: _Name) -> int:
        return sum(len(tally.latencies) for (_, name), tally in self.tallies.items() if name == path)


async def counted_rounds(
    settings: CountedSettings,
    paths: Sequence[_Name],
    measure: Callable[[_Name, CountedPhase], Awaitable[tuple[Sample, float]]],
    progress: Progress,
    *,
    ready: Mapping[Child, str],
    started: float,
    cores: str,
) -> Counted[_Name]:
    """Once every child answers its ``ready`` URL, every path at every number of connections,
    ``settings.rounds`` times, the path order rotating from round to round (``order``). Start-up
    has its own bound (``ready_timeout`` from ``started``, monotonic), and the measured phases keep
    their whole budget after it: each gets an even share of the time left until ``Counted.end``.
    ``measure`` runs one: its sample and the hop's CPU seconds."""
    await wait_all_ready(ready, started + settings.ready_timeout)
    end = time.monotonic() + settings.total_bound - settings.shutdown_reserve
    progress(f"ready after {time.monotonic() - started:.1f} s; {cores}")
    counted = Counted({(c, path): Tally() for c in settings.requests for path in paths}, end)
    left = len(settings.requests) * settings.rounds * len(paths)
    width = max(len(path) for path in paths)
    for connections, count in settings.requests.items():
        for round_ in range(settings.rounds):
            for path in order(paths, round_):
                bound = (end - time.monotonic()) / left
                left -= 1
                if bound <= 0.2:
                    raise BenchError("no time left for the measured phases (start-up too slow)")
                phase = CountedPhase(connections, count, settings.warmup * connections, bound)
                sample, cpu = await measure(path, phase)
                tally = counted.tallies[connections, path]
                tally.latencies += sample.latencies
                tally.wall += sample.wall
                tally.cpu += cpu
                if sample.bounded:
                    counted.stopped_early.append(f"c{connections} {path} round {round_ + 1}")
                done = len(sample.latencies)
                progress(
                    f"c{connections:<2} round {round_ + 1} {path:<{width}} {done:>6} in {sample.wall:5.2f} s"
                    f"  {done / sample.wall:7.0f}/s  p50 {ms(percentile(sample.latencies, 50)):6.2f} ms"
                )
    return counted


def render_counted(
    report: dict[str, Any],
    title: str,
    paths: Sequence[str],
    column: tuple[str, Callable[[dict[str, float]], str]],
    summary: Callable[[str], str],
    tail: list[str],
) -> str:
    """The table of a bench of counted phases (``counted_rounds``): ``title`` with the
    run's kind, length and cores; for each number of connections a row per path (requests, req/s,
    p50 ms and ``column``, a header and a cell) and its ``summary`` line; then ``tail`` and the
    phases stopped early."""
    width = max(len(path) for path in paths) + 1
    header, cell = column
    run = f"{'quick' if report['quick'] else 'full'} run, {report['seconds']:.1f} s; {report['cores']}"
    lines = [
        f"{title} ({run})",
        f"{'':<4} {'path':<{width}} {'requests':>8} {'req/s':>9} {'p50 ms':>8} {header}",
    ]
    for conns in report["ratios"]:
        for path in paths:
            f = report[path][conns]
            figures = f"{f['requests']:>8} {f['rps']:>9.0f} {f['p50_ms']:>8.2f}"
            lines.append(f"{conns:<4} {path:<{width}} {figures} {cell(f)}")
        lines.append(summary(conns))
    lines += tail
    if report["stopped_early"]:
        lines.append("stopped early by the time bound: " + ", ".join(report["stopped_early"]))
    return "\n".join(lines)
