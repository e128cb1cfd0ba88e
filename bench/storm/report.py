"""Figures of one ``bench.storm`` run, the table and the JSON (``out/bench-storm.json``).

``figures`` holds only positive numbers (the smoke test checks that);
``counts`` holds what may well be zero on a good run (dropped jobs, the
backlog at the end of the storm, blocks left stranded on P).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from bench.harness.procs import BenchError
from bench.harness.report import Environment, RunReport
from bench.harness.stats import ms, percentile
from bench.releases.metrics import RESULTS, Samples, release_latency_ms, released, sample


class LoadFigures(msgspec.Struct, kw_only=True):
    """The other requests (admitted JSON through the sidecar) in one phase."""

    requests: int
    rps: float
    p50_ms: float
    p99_ms: float
    sidecar_cpu_cores: float  # the sidecar process's CPU over the phase, in cores


class StormRate(msgspec.Struct, kw_only=True):
    """The storm itself: decode requests D rejected (400), all through the sidecar."""

    requests: int
    seconds: float
    rps: float


class ReleaseFigures(msgspec.Struct, kw_only=True):
    """Releases of the storm's rejections.

    ``p_confirmed`` / ``sidecar_sent`` count what happened between the storm's
    first request and its last answer (``*_per_s`` over that window: what was
    sustained); ``p_confirmed_total`` also counts the backlog freed after it.
    The latency is the sidecar's ``kvr_release_latency_seconds`` (D's answer
    reaching the sidecar to the release sent, queueing included), estimated
    from the histogram's buckets.
    """

    p_confirmed: int
    p_confirmed_per_s: float
    sidecar_sent: int
    sidecar_sent_per_s: float
    p_confirmed_total: int
    latency_p50_ms: float
    latency_p99_ms: float


class Figures(msgspec.Struct, kw_only=True):
    baseline: LoadFigures
    storm: LoadFigures
    # The same storm with bodies carrying no kv_transfer_params: D still rejects every one,
    # the sidecar releases nothing. Storm vs this is what the releases themselves cost.
    storm_no_release: LoadFigures
    # storm / baseline and storm_no_release / baseline, per figure of the other requests.
    ratios: dict[str, float]
    storm_rate: StormRate
    no_release_storm_rate: StormRate
    releases: ReleaseFigures


class Counts(msgspec.Struct, kw_only=True):
    """Counts over the storm and its drain; zero is a good value for most."""

    dropped: int  # release jobs evicted from the sidecar's full queue (kvr_releases_total{result="dropped"})
    failed: int  # jobs whose deadline passed before the release was sent
    refused: int  # jobs refused for good (allowlist, wire format)
    other_results: int  # duplicate, covered_by_engine, dry_run, off: none expected
    backlog_at_storm_end: int  # kvr_release_queue_depth when the storm's last answer arrived
    drain_seconds: float  # from the storm's end to every job finished and confirmed by P
    unconfirmed_after_drain: int  # rejections P never heard of (dropped, failed, or the drain timed out)
    stranded_on_p: int  # requests still pinned on P that were rejected (lease 0: pinned for good)
    unused_params: int  # prepared parameters the storm had no time to send (pinned on P, never rejected)


class StormReport(RunReport, kw_only=True):
    figures: Figures
    counts: Counts
    environment: Environment


@dataclass(frozen=True, slots=True)
class Storm:
    """One storm as the generator saw it."""

    started: float
    ended: float
    rejections: int
    unused: int

    @property
    def seconds(self) -> float:
        return self.ended - self.started

    def rate(self) -> StormRate:
        return StormRate(requests=self.rejections, seconds=self.seconds, rps=self.rejections / self.seconds)


def load_figures(latencies: list[float], seconds: float, sidecar_cores: float) -> LoadFigures:
    """The other requests' figures: ``latencies`` of those sent within ``seconds``."""
    if not latencies:
        raise BenchError("no other request completed inside the phase")
    return LoadFigures(
        requests=len(latencies),
        rps=len(latencies) / seconds,
        p50_ms=ms(percentile(latencies, 50)),
        p99_ms=ms(percentile(latencies, 99)),
        sidecar_cpu_cores=sidecar_cores,
    )


def release_figures(
    storm: Storm,
    drain_seconds: float,
    stats: tuple[dict[str, Any], dict[str, Any], dict[str, Any]],
    metrics: tuple[Samples, Samples, Samples],
) -> tuple[ReleaseFigures, Counts]:
    """The storm's releases from P's ``/stats`` and the sidecar's ``/metrics``, each read before the
    storm, at its end and after the drain."""
    (p0, p_end, p_after), (m0, m_end, m_after) = stats, metrics
    confirmed = p_end["freed_by_notification"] - p0["freed_by_notification"]
    total = p_after["freed_by_notification"] - p0["freed_by_notification"]
    sent = released(m0, m_end, "sent")
    figures = ReleaseFigures(
        p_confirmed=confirmed,
        p_confirmed_per_s=confirmed / storm.seconds,
        sidecar_sent=sent,
        sidecar_sent_per_s=sent / storm.seconds,
        p_confirmed_total=total,
        latency_p50_ms=release_latency_ms(m0, m_after, 0.5),
        latency_p99_ms=release_latency_ms(m0, m_after, 0.99),
    )
    others = [result for result in RESULTS if result not in {"sent", "dropped", "failed", "refused"}]
    counts = Counts(
        dropped=released(m0, m_after, "dropped"),
        failed=released(m0, m_after, "failed"),
        refused=released(m0, m_after, "refused"),
        other_results=sum(released(m0, m_after, result) for result in others),
        backlog_at_storm_end=int(sample(m_end, "kvr_release_queue_depth")),
        drain_seconds=drain_seconds,
        unconfirmed_after_drain=storm.rejections - total,
        stranded_on_p=p_after["pinned_requests"] - storm.unused,
        unused_params=storm.unused,
    )
    return figures, counts


def line(phase: str, figures: LoadFigures, storm: Storm | None) -> str:
    """The progress line of one phase."""
    text = (
        f"{phase:<20} other requests {figures.requests:>6}  {figures.rps:7.0f}/s"
        f"  p50 {figures.p50_ms:6.2f} ms  p99 {figures.p99_ms:7.2f} ms"
        f"  sidecar CPU {figures.sidecar_cpu_cores:.2f}"
    )
    if storm is not None:
        text += f"; storm {storm.rejections} rejections in {storm.seconds:.1f} s"
    return text


def ratios(baseline: LoadFigures, storm: LoadFigures, no_release: LoadFigures) -> dict[str, float]:
    result: dict[str, float] = {}
    for prefix, phase in (("storm", storm), ("no_release", no_release)):
        result[f"{prefix}.rps"] = phase.rps / baseline.rps
        result[f"{prefix}.p50_ms"] = phase.p50_ms / baseline.p50_ms
        result[f"{prefix}.p99_ms"] = phase.p99_ms / baseline.p99_ms
    return result


def render(report: StormReport) -> str:
    """The table printed after a run."""
    f, c = report.figures, report.counts
    mode = "quick" if report.quick else "full"
    conns = report.settings.get("normal_connections")
    storm_conns = report.settings.get("storm_connections")
    lines = [
        f"kv-release-sidecar rejection-storm bench ({mode}, {report.seconds:.0f} s; {report.cores})",
        f"other requests: admitted JSON, {conns} conns  {'baseline':>9} {'storm':>9} {'ratio':>7}"
        f" {'no-release':>11} {'ratio':>7}",
    ]
    rows = [
        ("req/s", "rps", "{:9.0f}"),
        ("p50 ms", "p50_ms", "{:9.2f}"),
        ("p99 ms", "p99_ms", "{:9.2f}"),
    ]
    for label, key, fmt in rows:
        base, storm, control = (getattr(p, key) for p in (f.baseline, f.storm, f.storm_no_release))
        lines.append(
            f"  {label:<39}{fmt.format(base)} {fmt.format(storm)} {f.ratios['storm.' + key]:6.2f}x"
            f"  {fmt.format(control)} {f.ratios['no_release.' + key]:6.2f}x"
        )
    lines.append(
        f"  {'sidecar CPU, cores':<39}{f.baseline.sidecar_cpu_cores:9.2f} {f.storm.sidecar_cpu_cores:9.2f}"
        f" {'':>7}  {f.storm_no_release.sidecar_cpu_cores:9.2f}"
    )
    r = f.releases
    lines += [
        f"storm ({storm_conns} conns, every request a 400 from D): {f.storm_rate.rps:.0f} rejections/s for "
        f"{f.storm_rate.seconds:.1f} s ({f.storm_rate.requests}); no-release storm "
        f"{f.no_release_storm_rate.rps:.0f}/s",
        f"releases sustained during the storm: {r.p_confirmed_per_s:.0f}/s confirmed by P "
        f"({r.p_confirmed}), sidecar sent {r.sidecar_sent_per_s:.0f}/s ({r.sidecar_sent})",
        f"after the storm: backlog {c.backlog_at_storm_end} jobs, drained in {c.drain_seconds:.2f} s; "
        f"{r.p_confirmed_total} confirmed by P in all, {c.unconfirmed_after_drain} never",
        f"release latency (D's answer -> sent, queueing included; from buckets): "
        f"p50 {r.latency_p50_ms:.1f} ms, p99 {r.latency_p99_ms:.1f} ms",
        f"release jobs dropped (queue full): {c.dropped}; failed {c.failed}; refused {c.refused}; "
        f"other {c.other_results}; rejected requests left pinned on P: {c.stranded_on_p}",
    ]
    env = report.environment
    shares = ", ".join(
        f"{phase} {cpu.load_core:.2f}/{cpu.sidecar_core:.2f}" for phase, cpu in env.other_cpu.items()
    )
    lines.append(
        f"other processes' CPU, cores (load core / sidecar core): {shares}; load average "
        f"{env.loadavg_start:.1f} -> {env.loadavg_end:.1f}"
    )
    if env.disturbed:
        lines.append("WARNING: other processes were busy on the benchmark's cores; the figures are disturbed")
    return "\n".join(lines)
