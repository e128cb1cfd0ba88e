"""The many-streams workload's figures: per round, mode and path; what each hop adds; targets.

``StreamsReport`` is what ``out/bench-streams.json`` holds. Each round
measures every path of each mode once (its order rotating), and every round is
kept and printed: runs that disagree are shown side by side, not averaged
away. A hop's figures are read against direct's of the same round (``added``),
and the sidecar's targets are judged per round beside nginx's figures.
``bench.streams.render`` prints it.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from bench.harness.profile import Profile
from bench.harness.report import RunReport
from bench.streams.cstreams import StreamsSample

Mode = Literal["sidecar", "router"]


class HopLoad(msgspec.Struct, kw_only=True):
    """What the hop and the load side used during one path's phase (cores' worth over its wall time)."""

    hop_cores: float  # the hop's processes (0 on the direct path)
    hop_us_per_event: float  # the hop's CPU per event the clients received (requests included)
    hop_us_per_stream: float = 0.0  # the same per stream (ramp and drain included)
    hop_rss_peak_mb: float
    hop_fds_peak: int
    client_cores: float  # the C load generator
    decode_cores: float  # the fake D (and the fake P, in router mode)
    other_load_core: float  # other processes on the load core
    other_hop_core: float  # other processes on the hop's core
    waited_s: float = 0.0  # waited for a quiet spell before the phase
    others_before: float = 0.0  # other processes' cores' worth in the second before it began


class PathRun(msgspec.Struct, kw_only=True):
    """One path, one phase: what the clients measured and what it cost."""

    sample: StreamsSample
    load: HopLoad
    recovery: StreamsSample | None = None  # a smaller phase right after, on the same path
    profile: Profile | None = None  # where a sidecar's CPU went (``--profile``)
    burst: StreamsSample | None = None  # the accept-burst step's new clients (sidecar mode)
    # What the fake P got during the main phase (router mode; ``bench.servers.fakes.COUNTS``).
    prefill: dict[str, int] | None = None


class Added(msgspec.Struct, kw_only=True):
    """What a hop adds over direct in the same round, ms (noise can make it negative)."""

    ttft_p50_ms: float
    ttft_p99_ms: float
    ttft_max_ms: float
    gap_p99_ms: float


class Target(msgspec.Struct, kw_only=True):
    figure: str
    value: float
    limit: float
    nginx: float | None  # nginx's same figure in the same round, when it ran
    passed: bool


class Versus(msgspec.Struct, kw_only=True):
    """The sidecar against vllm-router, one pair of paths in one round."""

    ours: str
    theirs: str
    rate: float  # streams/s
    their_rate: float
    ttft_p99_ms: float
    their_ttft_p99_ms: float
    passed: bool


class RoundMode(msgspec.Struct, kw_only=True):
    round: int
    mode: Mode
    order: list[str]
    paths: dict[str, PathRun]
    added: dict[str, Added]  # by hop
    targets: list[Target]
    versus: list[Versus] = []  # router mode beside vllm-router (``bench.streams.versus``)


class Machine(msgspec.Struct, kw_only=True):
    """The machine's state at the start and end of the run."""

    loadavg_start: str
    loadavg_end: str
    busiest_start: list[tuple[str, float]]  # other processes, cores' worth over a second
    busiest_end: list[tuple[str, float]]


class StreamsReport(RunReport, kw_only=True):
    machine: Machine
    runs: list[RoundMode]
    skipped: list[str]  # paths not measured, and why


# The targets: (mode, figure, limit); a figure name is an ``Added`` field, "errors" or "rss".
TARGETS: list[tuple[Mode, str, float]] = [
    ("sidecar", "ttft_p50_ms", 2.0),
    ("sidecar", "ttft_p99_ms", 20.0),
    ("sidecar", "errors", 0.0),
    ("sidecar", "hop_rss_peak_mb", 150.0),
    ("router", "ttft_p99_ms", 40.0),
]


def added(direct: StreamsSample, hop: StreamsSample) -> Added:
    return Added(
        ttft_p50_ms=hop.ttft_p50_ms - direct.ttft_p50_ms,
        ttft_p99_ms=hop.ttft_p99_ms - direct.ttft_p99_ms,
        ttft_max_ms=hop.ttft_max_ms - direct.ttft_max_ms,
        gap_p99_ms=hop.gap_p99_ms - direct.gap_p99_ms,
    )


def _figure(name: str, path: str, runs: dict[str, PathRun], adds: dict[str, Added]) -> float | None:
    if path not in runs:
        return None
    if name == "errors":
        return float(runs[path].sample.errors)
    if name == "hop_rss_peak_mb":
        return runs[path].load.hop_rss_peak_mb
    return float(getattr(adds[path], name)) if path in adds else None


def targets(mode: Mode, runs: dict[str, PathRun], adds: dict[str, Added]) -> list[Target]:
    """The sidecar's targets for ``mode``, judged on one round, with nginx's same figure."""
    judged = []
    for target_mode, name, limit in TARGETS:
        value = _figure(name, "sidecar", runs, adds)
        if target_mode != mode or value is None:
            continue
        nginx = _figure(name, "nginx", runs, adds)
        judged.append(Target(figure=name, value=value, limit=limit, nginx=nginx, passed=value <= limit))
    return judged
