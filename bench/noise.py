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

import os
import time
from dataclasses import dataclass
from pathlib import Path

from bench.procs import CorePlan, Servers

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


def snapshot(plan: CorePlan, servers: Servers) -> Snapshot:
    busy = core_busy()
    load = sum(busy.get(cpu, 0.0) for cpu in plan.load)
    sidecar = sum(busy.get(cpu, 0.0) for cpu in plan.sidecar)
    ours_load = time.process_time() + servers.decode.cpu_seconds()
    ours_sidecar = sum(proxy.cpu_seconds() for proxy in servers.proxies())
    if not plan.pinned:  # everything shares the same CPUs: count it all on the load side
        return Snapshot(time.monotonic(), load, 0.0, ours_load + ours_sidecar, 0.0)
    return Snapshot(time.monotonic(), load, sidecar, ours_load, ours_sidecar)


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
