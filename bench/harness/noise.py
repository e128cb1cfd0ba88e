"""How much CPU processes other than the benchmark's took on its cores during a phase.

The machine may be shared (test suites, other benchmarks). Per-core busy time
comes from ``/proc/stat`` (user + nice + system); what the benchmark's own
processes used on each core (this process, wrk and D on the load core, the
sidecar and the reference hops on the other) is subtracted, and the rest,
as a share of one core over the phase's wall time, is reported next to the
figures. Interrupt time is left out of both sides, so loopback networking is
not counted as noise.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bench.harness.procs import CorePlan

_TICKS = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Busy seconds per core of interest, and what of it was the benchmark's own."""

    at: float
    load_busy: float
    sidecar_busy: float
    load_ours: float
    sidecar_ours: float


def core_busy() -> dict[int, float]:
    """user + nice + system seconds of every CPU since boot."""
    busy: dict[int, float] = {}
    for line in Path("/proc/stat").read_text().splitlines():
        name, *fields = line.split()
        if name.startswith("cpu") and name != "cpu":
            busy[int(name[3:])] = sum(int(f) for f in fields[:3]) / _TICKS
    return busy


def snapshot_of(plan: CorePlan, ours_load: float, ours_sidecar: float) -> Snapshot:
    """Each core's busy seconds now, beside the CPU seconds the benchmark's own processes on it
    have used (``ours_load``: this process and what shares its core; ``ours_sidecar``: the hops)."""
    busy = core_busy()
    load = sum(busy.get(cpu, 0.0) for cpu in plan.load)
    sidecar = sum(busy.get(cpu, 0.0) for cpu in plan.sidecar)
    if not plan.pinned:  # everything shares the same CPUs: count it all on the load side
        return Snapshot(time.monotonic(), load, 0.0, ours_load + ours_sidecar, 0.0)
    return Snapshot(time.monotonic(), load, sidecar, ours_load, ours_sidecar)


def loadavg() -> str:
    """``/proc/loadavg`` as it reads: the 1, 5 and 15 minute load averages, runnable/all tasks, last pid."""
    return Path("/proc/loadavg").read_text().strip()


def process_cpu() -> dict[int, tuple[str, float]]:
    """Every process's name and CPU seconds (user + system) so far, from ``/proc/<pid>/stat``."""
    found: dict[int, tuple[str, float]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:  # gone meanwhile
            continue
        name = text[text.index("(") + 1 : text.rindex(")")]
        fields = text[text.rindex(")") + 2 :].split()
        found[int(stat.parent.name)] = (name, (int(fields[11]) + int(fields[12])) / _TICKS)
    return found


def busiest(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]], seconds: float,
            exclude: set[int], top: int = 5) -> list[tuple[str, float]]:  # fmt: skip
    """The processes (not in ``exclude``) that used the most CPU between two ``process_cpu``
    readings ``seconds`` apart, as (``name pid``, cores' worth), at most ``top``, each over 0.01."""
    used = [
        (f"{name} {pid}", (cpu - before[pid][1]) / seconds)
        for pid, (name, cpu) in after.items()
        if pid in before and pid not in exclude
    ]
    return sorted((u for u in used if u[1] > 0.01), key=lambda u: -u[1])[:top]


async def wait_quiet(
    plan: CorePlan, ours: Callable[[], float], threshold: float, bound: float
) -> tuple[float, float]:
    """Wait until other processes use at most ``threshold`` cores' worth of the benchmark's
    cores over one second (``ours``: the CPU seconds of everything the benchmark runs), or until
    ``bound`` seconds have passed. Returns the seconds waited and the last second's reading: on
    a shared machine a phase then starts in a quiet spell, when there is one."""
    cpus = plan.load | plan.sidecar
    waited, started = 0.0, time.monotonic()
    while True:
        busy, own = core_busy(), ours()
        await asyncio.sleep(1.0)  # the span of one reading
        after, own_after = core_busy(), ours()
        others = sum(after.get(c, 0.0) - busy.get(c, 0.0) for c in cpus) - (own_after - own)
        waited = time.monotonic() - started
        if others <= threshold or waited >= bound:
            return waited, max(0.0, others)


@dataclass(slots=True)
class Other:
    """Other processes' CPU seconds on each core, accumulated over phases."""

    load: float = 0.0
    sidecar: float = 0.0
    wall: float = 0.0

    def add(self, before: Snapshot, after: Snapshot) -> None:
        self.wall += after.at - before.at
        load = (after.load_busy - before.load_busy) - (after.load_ours - before.load_ours)
        self.load += max(0.0, load)
        sidecar = (after.sidecar_busy - before.sidecar_busy) - (after.sidecar_ours - before.sidecar_ours)
        self.sidecar += max(0.0, sidecar)

    def shares(self) -> tuple[float, float]:
        """Cores' worth of other work on the load core and on the sidecar core."""
        if self.wall <= 0:
            return 0.0, 0.0
        return self.load / self.wall, self.sidecar / self.wall
