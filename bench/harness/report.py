"""What every bench's report shares: the run's fields, the machine's quiet, the JSON it is written as.

``RunReport`` holds the fields the storm, streams and releases reports
begin with; ``Environment`` says how much CPU other processes took on the
benchmark's cores during each path (or phase) and whether that disturbed the
figures; ``write_json`` writes any report, a msgspec struct or plain dicts.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec

from bench.harness.noise import Other

# Other processes taking more than this share of one of the benchmark's cores disturb it.
DISTURBED_SHARE = 0.1


MB = 1e6


class OtherCpu(msgspec.Struct, kw_only=True):
    """Cores' worth of CPU that other processes took on the load core and the sidecar core during
    one path's measured phases (or one phase of the storm bench)."""

    load_core: float
    sidecar_core: float


def other_cpu(other: Other) -> OtherCpu:
    load, sidecar = other.shares()
    return OtherCpu(load_core=load, sidecar_core=sidecar)


class Environment(msgspec.Struct, kw_only=True):
    """How quiet the machine was: figures taken beside other busy processes are disturbed."""

    loadavg_start: float
    loadavg_end: float
    other_cpu: dict[str, OtherCpu]  # by path (by phase in the storm bench)
    disturbed: bool


def environment(loadavg: tuple[float, float], other: dict[str, OtherCpu]) -> Environment:
    shares = [share for cpu in other.values() for share in (cpu.load_core, cpu.sidecar_core)]
    return Environment(
        loadavg_start=loadavg[0],
        loadavg_end=loadavg[1],
        other_cpu=other,
        disturbed=max(shares) > DISTURBED_SHARE,
    )


class RunReport(msgspec.Struct, kw_only=True):
    """The fields the storm, streams and releases reports begin with (the paths report orders its own)."""

    quick: bool  # a smoke run
    cores: str  # which CPUs the load side and the sidecars got (``CorePlan.describe``)
    settings: dict[str, object]
    seconds: float  # the whole run, start-up and shutdown included


def write_json(report: msgspec.Struct | dict[str, Any], path: Path) -> None:
    """A report's raw figures, indented, into ``path`` (its directory made if need be); a report of
    plain dicts (the router and tracing benches') as the ``json`` module writes it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(report, dict):
        path.write_text(json.dumps(report, indent=2) + "\n")
    else:
        path.write_bytes(msgspec.json.format(msgspec.json.encode(report)) + b"\n")
