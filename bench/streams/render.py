"""The many-streams workload's table: every round's paths side by side, its targets, its readings.

One column per path of a round (``ROWS`` in order), then the sidecar's
targets beside nginx's figures, the accept burst against nginx's, each
sidecar's cost against nginx's with as many processes, router mode beside
vllm-router (``bench.streams.versus``), one worker beside two, and the
profiles taken with ``--profile``.
"""

from __future__ import annotations

from typing import cast

from bench.harness import profile
from bench.streams.cstreams import StreamsSample
from bench.streams.report import Added, PathRun, RoundMode, StreamsReport
from bench.streams.versus import versus_lines, workers_burst, workers_lines


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
