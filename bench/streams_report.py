"""The many-streams workload's figures: per round, mode and path; what each hop adds; targets; the table.

``StreamsReport`` is what ``out/bench-streams.json`` holds. Each round
measures every path of each mode once (its order rotating), and every round is
kept and printed: runs that disagree are shown side by side, not averaged
away. A hop's figures are read against direct's of the same round (``added``),
and the sidecar's targets are judged per round beside nginx's figures.
"""

from __future__ import annotations

from typing import Literal, cast

import msgspec

from bench import profile
from bench.cstreams import StreamsSample
from bench.profile import Profile
from bench.report import RunReport
from bench.streams_versus import Versus, versus_lines, workers_burst, workers_lines

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
    # What the fake P got during the main phase (router mode; ``bench.fast_servers.COUNTS``).
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


class RoundMode(msgspec.Struct, kw_only=True):
    round: int
    mode: Mode
    order: list[str]
    paths: dict[str, PathRun]
    added: dict[str, Added]  # by hop
    targets: list[Target]
    versus: list[Versus] = []  # router mode beside vllm-router (``bench.streams_versus``)


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


def _ms(value: float) -> str:
    return f"{value:,.1f}"


def _cells(run: PathRun, add: Added | None) -> list[str]:
    """One path's column of a round's table, in ``ROWS`` order."""
    s, load, after = run.sample, run.load, run.recovery
    ttft = "/".join(_ms(v) for v in (s.ttft_p50_ms, s.ttft_p99_ms, s.ttft_max_ms))
    more = (
        "-"
        if add is None
        else "/".join(f"{v:+,.1f}" for v in (add.ttft_p50_ms, add.ttft_p99_ms, add.ttft_max_ms))
    )
    return [
        f"{s.streams:,} ({s.errors})" + "".join(f", {n:,} x {code}" for code, n in s.statuses.items()),
        ttft,
        more,
        f"{_ms(s.gap_p50_ms)}/{_ms(s.gap_p99_ms)}",
        f"{load.hop_cores:.2f}",
        f"{load.hop_us_per_event:.1f}",
        f"{load.hop_rss_peak_mb:.0f} / {load.hop_fds_peak}",
        f"{load.client_cores:.2f} / {load.decode_cores:.2f}",
        f"{load.other_load_core:.2f} / {load.other_hop_core:.2f}",
        f"{load.waited_s:.0f} s, {load.others_before:.2f}",
        "-" if after is None else f"{_ms(after.ttft_p50_ms)}/{_ms(after.ttft_p99_ms)}",
        "-" if after is None else " ".join(f"{p99:.0f}" for _, _, p99 in after.timeline[:5]),
        "-" if run.burst is None else f"{run.burst.streams:,} ({run.burst.errors})",
        "-" if run.burst is None else "/".join(_ms(v) for v in _ttfts(run.burst)),
    ]


def _ttfts(s: StreamsSample) -> tuple[float, float, float]:
    return s.ttft_p50_ms, s.ttft_p99_ms, s.ttft_max_ms


ROWS = [
    "streams completed (errors)",
    "TTFT p50 / p99 / max ms",
    "TTFT added p50 / p99 / max ms",
    "event gap p50 / p99 ms",
    "hop CPU, cores",
    "hop CPU per event, us",
    "hop RSS peak MB / fds peak",
    "load core: client / D+P",
    "others: load / hop core",
    "waited for quiet, others then",
    "after: TTFT p50 / p99 ms",
    "after: p99 per second ms",
    "burst: new streams (errors)",
    "burst: TTFT p50 / p99 / max ms",
]


def _table(run: RoundMode) -> list[str]:
    order = ("direct", "sidecar", "sidecar-w2", "limited", "baseline", "relay", "nginx", "nginx-w2",
             "vllm-router", "vllm-router-w2")  # fmt: skip
    paths = [p for p in order if p in run.paths]
    columns = [[p, *_cells(run.paths[p], run.added.get(p))] for p in paths]
    labels = ["path", *ROWS]
    width = max(len(label) for label in labels)
    widths = [max(len(cell) for cell in column) for column in columns]
    return [
        f"  {label:<{width}}  " + "  ".join(f"{col[i]:>{w}}" for col, w in zip(columns, widths, strict=True))
        for i, label in enumerate(labels)
    ]


def render(report: StreamsReport) -> str:
    """Every round's table, then the targets per round."""
    settings = report.settings
    lines = [
        f"many streams ({'quick' if report.quick else 'full'} run, {report.seconds:.0f} s; {report.cores})",
        f"{settings['clients']} clients, each a closed loop of streams of {settings['events']} events over "
        f"{settings['duration']} s; measured {settings['seconds']} s after a {settings['ramp']} s ramp; "
        f"'after': {settings['recovery_clients']} clients right after; 'burst': {settings['burst']} new "
        f"connections at once {settings['burst_at']} s into the clients' streams (sidecar mode)",
        f"machine: loadavg {report.machine.loadavg_start} -> {report.machine.loadavg_end}; busiest others "
        f"at start {_busy(report.machine.busiest_start)}, at end {_busy(report.machine.busiest_end)}",
    ]
    for run in report.runs:
        lines.append("")
        lines.append(f"round {run.round}, {run.mode} mode (order: {', '.join(run.order)})")
        lines += _table(run)
        for target in run.targets:
            verdict = "PASS" if target.passed else "MISS"
            nginx = "" if target.nginx is None else f"; nginx {target.nginx:,.1f}"
            value = f"{target.value:,.1f}"
            lines.append(f"  target {target.figure} <= {target.limit:g}: sidecar {value}{nginx}  {verdict}")
        lines += _burst_verdict(run)
        lines += _ratios(run)
        window, events = cast(float, settings["seconds"]), cast(int, settings["events"])
        lines += versus_lines(run.paths, run.versus, window, events)
    bursts = [(run.round, w) for run in report.runs if (w := workers_burst(run.paths)) is not None]
    lines += workers_lines(bursts)
    for run in report.runs:
        for path, entry in run.paths.items():
            if entry.profile is not None:
                lines += profile.render(f"round {run.round}, {run.mode} mode, {path}", entry.profile)
    if report.skipped:
        lines.append("skipped: " + "; ".join(report.skipped))
    return "\n".join(lines)


def _ratios(run: RoundMode) -> list[str]:
    """Each sidecar's cost against nginx's with as many processes, in this round: CPU per event
    and TTFT p99 added over direct."""
    found = []
    for ours, theirs in (("sidecar", "nginx"), ("sidecar-w2", "nginx-w2")):
        mine, ref = run.paths.get(ours), run.paths.get(theirs)
        if mine is None or ref is None or not ref.load.hop_us_per_event:
            continue
        cpu = mine.load.hop_us_per_event / ref.load.hop_us_per_event
        text = f"  {ours} / {theirs}: CPU per event {cpu:.2f}x"
        add, ref_add = run.added.get(ours), run.added.get(theirs)
        if add is not None and ref_add is not None and ref_add.ttft_p99_ms > 0:
            text += f", TTFT p99 added {add.ttft_p99_ms / ref_add.ttft_p99_ms:.2f}x"
        found.append(text)
    return found


def _burst_verdict(run: RoundMode) -> list[str]:
    """The burst's TTFT p99 against nginx's in the same round (the goal: no worse)."""
    ours, nginx = run.paths.get("sidecar"), run.paths.get("nginx")
    if ours is None or ours.burst is None or nginx is None or nginx.burst is None:
        return []
    mine, theirs = ours.burst.ttft_p99_ms, nginx.burst.ttft_p99_ms
    verdict = "PASS" if mine <= theirs else "MISS"
    return [f"  burst TTFT p99 <= nginx's: sidecar {mine:,.1f}; nginx {theirs:,.1f}  {verdict}"]


def _busy(found: list[tuple[str, float]]) -> str:
    return ", ".join(f"{name} {share:.2f}" for name, share in found) or "none over 0.01 core"
