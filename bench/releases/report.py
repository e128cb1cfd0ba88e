"""Figures of one ``python -m bench --workload releases`` run, and its table.

Each ``Step`` is one rate held for a while and what the sidecar and P made of
it; ``ReleasesReport`` is what ``out/bench-releases.json`` holds.
"""

from __future__ import annotations

import msgspec

from bench.harness import profile
from bench.harness.profile import Profile
from bench.harness.report import RunReport


class Step(msgspec.Struct, kw_only=True):
    """One rate, held for a while: what the sidecar and P made of it."""

    rate: float  # offered, requests/s
    seconds: float
    sent: int
    answered: int  # 400s the client had back
    send_late_p99_ms: float  # how far behind schedule the load generator sent (its own health)
    answer_p50_ms: float  # the sidecar's answer, from the scheduled send
    answer_p99_ms: float
    freed: int  # of this step's requests, freed by P within ``settle`` of the step's end
    freed_p50_ms: float  # from the client having D's answer to P having freed the blocks
    freed_p99_ms: float
    freed_max_ms: float
    sidecar_sent: int  # releases the sidecar counted as sent, once P's records settled (or ``settle`` passed)
    # The sidecar's own part: from D's answer reaching it to the release sent (its histogram).
    sidecar_latency_p50_ms: float
    sidecar_latency_p99_ms: float
    sidecar_other: dict[str, int]  # its other release results (dropped, failed, ...)
    backlog_end: int  # release jobs queued as the step ended
    sidecar_cores: float
    sidecar_rss_peak_mb: float
    load_cores: float  # this process (the load generator), P and D together
    other_load_core: float
    other_hop_core: float
    kept_up: bool
    waited_s: float = 0.0  # waited for a quiet spell before the step
    others_before: float = 0.0  # other processes' cores' worth in the second before it began
    hop: str = "sidecar"  # which sidecar: this tree's, or "baseline" (``--baseline``)
    drained_s: float = 0.0  # waited for the sidecars' earlier release backlog to drain
    profile: Profile | None = None  # where the sidecar's CPU went (``--profile``, main step)


class ReleasesReport(RunReport, kw_only=True):
    prepared: int
    prepare_seconds: float
    loadavg_start: str
    loadavg_end: str
    steps: list[Step]
    main: int  # index of the main step
    stopped_keeping_up: float | None  # the first offered rate it did not keep up with, if any
    baseline: str = ""  # the other checkout, when one ran
    baseline_steps: list[Step] = msgspec.field(default_factory=list)  # its steps, as ``steps``
    baseline_stopped_keeping_up: float | None = None


def line(s: Step) -> str:
    """A step's progress line."""
    return (
        f"{s.rate:>6.0f}/s for {s.seconds:4.1f} s: {s.answered}/{s.sent} answered, P freed {s.freed} "
        f"(p50 {s.freed_p50_ms:.1f} ms, p99 {s.freed_p99_ms:.1f} ms), sidecar sent {s.sidecar_sent} "
        f"(its part p50 {s.sidecar_latency_p50_ms:.1f} ms, p99 {s.sidecar_latency_p99_ms:.1f} ms), "
        f"backlog {s.backlog_end}, sidecar {s.sidecar_cores:.2f} cores, {s.sidecar_rss_peak_mb:.0f} MB, "
        f"load side {s.load_cores:.2f}, others {s.other_load_core:.2f}/{s.other_hop_core:.2f} (waited "
        f"{s.waited_s:.0f} s for {s.others_before:.2f})"
        f"{'' if s.kept_up else '  NOT KEPT UP'}"
    )


def render(report: ReleasesReport) -> str:
    lines = [
        f"release throughput ({'quick' if report.quick else 'full'} run, {report.seconds:.0f} s; "
        f"{report.cores})",
        f"P: sim-prefill TP {report.settings['tp']}, {report.prepared} requests prefilled beforehand (per "
        f"sidecar) in {report.prepare_seconds:.0f} s; loadavg {report.loadavg_start} -> {report.loadavg_end}",
    ]
    runs = [("sidecar", report.steps, report.stopped_keeping_up)]
    if report.baseline:
        stop = report.baseline_stopped_keeping_up
        runs.append((f"baseline ({report.baseline})", report.baseline_steps, stop))
    for name, steps, stop in runs:
        lines += ["", name + ":", *_table(steps, report.main)]
        lines.append("stopped keeping up at: " + (f"{stop:.0f}/s" if stop else "every rate tried kept up"))
    for name, steps, _ in runs:
        for s in steps:
            if s.profile is not None:
                lines += profile.render(f"{name}, {s.rate:.0f}/s", s.profile, top=15)
    return "\n".join(lines)


def _table(steps: list[Step], main_index: int) -> list[str]:
    lines = [
        f"{'rate/s':>7} {'secs':>5} {'answered':>9} {'P freed':>8} {'freed p50':>9} {'p99':>7} {'max':>7} "
        f"{'sent':>7} {'its p50':>7} {'p99':>6} {'backlog':>7} {'CPU':>5} {'RSS MB':>6} {'load':>5} "
        f"{'others':>9} {'late p99':>8} {'drop':>6}",
    ]
    for index, s in enumerate(steps):
        mark = " <- main" if index == main_index else "" if s.kept_up else " <- not kept up"
        lines.append(
            f"{s.rate:>7.0f} {s.seconds:>5.1f} {s.answered:>9} {s.freed:>8} {s.freed_p50_ms:>9.1f} "
            f"{s.freed_p99_ms:>7.1f} {s.freed_max_ms:>7.1f} {s.sidecar_sent:>7} "
            f"{s.sidecar_latency_p50_ms:>7.1f} {s.sidecar_latency_p99_ms:>6.1f} {s.backlog_end:>7} "
            f"{s.sidecar_cores:>5.2f} {s.sidecar_rss_peak_mb:>6.0f} {s.load_cores:>5.2f} "
            f"{s.other_load_core:>4.2f}/{s.other_hop_core:.2f} {s.send_late_p99_ms:>8.1f} "
            f"{s.sidecar_other.get('dropped', 0):>6}{mark}"
        )
    main = steps[main_index] if len(steps) > main_index else None
    if main is not None:
        verdict = "PASS" if main.kept_up and main.freed_p99_ms <= 20 else "MISS"
        lines.append(
            f"target: {main.rate:.0f}/s sustained with P freed p99 <= 20 ms: {main.freed}/{main.sent} freed, "
            f"p99 {main.freed_p99_ms:.1f} ms  {verdict}"
        )
    return lines
