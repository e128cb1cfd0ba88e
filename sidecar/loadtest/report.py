"""The report of a run: one JSON-ready dict, and a short table for the terminal.

``build_report`` turns what ``runner`` measured (``RunData``) into plain
data: settings, outcomes, throughput, TTFT and total latency percentiles,
rejections by status, the sidecar's release counters, P's pinned blocks
(peak, block-seconds, refusals, frees by cause), the fate on P of every
rejected request (simulator only), the verdict, P's sampled series and one
record per flow. ``render_table`` prints the essentials of that dict.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from sidecar.loadtest.config import LoadConfig
from sidecar.loadtest.driver import DriverStats
from sidecar.loadtest.flow import REJECTED, FlowResult
from sidecar.loadtest.probes import PSnapshot
from sidecar.loadtest.verdict import Evidence, Verdict


@dataclass
class Series:
    """P sampled over the run: seconds since start, blocks in use, pinned requests."""

    t: list[float]
    blocks: list[float | None]
    pinned_requests: list[int | None]

    def peak(self) -> float | None:
        values = [b for b in self.blocks if b is not None]
        return max(values) if values else None

    def block_seconds(self) -> float | None:
        """Left Riemann sum of the sampled blocks in use."""
        pairs = [(t, b) for t, b in zip(self.t, self.blocks, strict=True) if b is not None]
        if not pairs:
            return None
        return sum(b * (t2 - t1) for (t1, b), (t2, _) in itertools.pairwise(pairs))


@dataclass
class RunData:
    """Everything one run measured."""

    config: LoadConfig
    model: str
    driver: DriverStats
    elapsed: float  # from the first arrival until every flow ended
    series: Series
    before: PSnapshot
    after: PSnapshot
    evidence: Evidence
    verdict: Verdict


def percentiles(values: Sequence[float]) -> dict[str, float | None]:
    """p50/p90/p99/max in milliseconds (nearest rank); None when there are no values."""
    ordered = sorted(values)
    out: dict[str, float | None] = {}
    for name, q in (("p50", 0.50), ("p90", 0.90), ("p99", 0.99), ("max", 1.0)):
        rank = max(0, math.ceil(q * len(ordered)) - 1)
        out[name] = round(ordered[rank] * 1000, 2) if ordered else None
    return out


def deltas(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, float]:
    """``after - before`` for every counter ``after`` has (gauges are taken as they are)."""
    return {k: round(v - before.get(k, 0.0), 3) if k != "queue_depth" else v for k, v in after.items()}


def rejection_key(flow: FlowResult) -> str:
    """``"400"``, ``"200+SSE 400"``; ``" (injected)"`` when the sidecar injected it."""
    key = f"200+SSE {flow.stream_error}" if flow.outcome == "stream_rejected" else str(flow.decode_status)
    return key + (" (injected)" if flow.injected else "")


def rejected_fates(
    flows: Sequence[FlowResult], p_requests: Mapping[str, Mapping[str, Any] | None] | None
) -> dict[str, int] | None:
    """How P freed the blocks of each rejected request: notification, expiry, still pinned."""
    if p_requests is None:
        return None
    fates: Counter[str] = Counter()
    for flow in flows:
        if flow.outcome in REJECTED and flow.p_request_id:
            fates[fate_of(p_requests.get(flow.p_request_id))] += 1
    return dict(fates)


def fate_of(record: Mapping[str, Any] | None) -> str:
    """``freed_by_notification``, ``freed_by_expiry``, ``still_pinned`` or ``unknown``."""
    if record is None:
        return "unknown"
    return f"freed_by_{record['freed_by']}" if record.get("freed_by") else "still_pinned"


def build_report(run: RunData) -> dict[str, Any]:
    """The JSON report of one run (see the module docstring)."""
    flows, config, ev = run.evidence.flows, run.config, run.evidence
    ok = [flow for flow in flows if flow.outcome == "ok"]
    rejected = [flow for flow in flows if flow.outcome in REJECTED]
    origins = (
        Counter(
            str((ev.d_log.get(flow.request_id) or {}).get("origin", "never reached D")) for flow in rejected
        )
        if ev.d_log is not None
        else None
    )
    return {
        "settings": msgspec.to_builtins(config)
        | {"model": run.model, "api_key": "***" if config.api_key else ""},
        "p_probe": ev.p_kind,
        "elapsed_s": round(run.elapsed, 3),
        "requests": {
            "started": run.driver.started,
            "dropped": run.driver.dropped,
            "by_outcome": dict(Counter(flow.outcome for flow in flows)),
        },
        "offered_rps": _rate(run.driver.started, run.driver.arrival_seconds),
        "throughput_rps": _rate(len(ok), run.elapsed),
        "latency_ms": {
            "ttft": percentiles([f.ttft for f in ok if f.ttft is not None]),
            "total": percentiles([f.total for f in ok]),
            "prefill": percentiles([f.prefill_seconds for f in flows if f.prefill_status == 200]),
        },
        "rejections": {
            "total": len(rejected),
            "by_status": dict(Counter(rejection_key(flow) for flow in rejected)),
            "by_type": dict(Counter(f"{flow.decode_status} {flow.error_type or '-'}" for flow in rejected)),
            "by_d_origin": dict(origins) if origins is not None else None,
        },
        "releases": dict(ev.sidecar_delta) if ev.sidecar_delta is not None else None,
        "p": _p_section(run),
        "rejected_fates": rejected_fates(flows, ev.p_requests),
        "verdict": {
            "ok": run.verdict.ok,
            "line": run.verdict.line,
            "problems": list(run.verdict.problems),
            "notes": list(run.verdict.notes),
            "wrong_releases": run.verdict.wrong_releases,
            "unknown_notifications": run.verdict.unknown_notifications,
            "admitted_without_tokens": run.verdict.admitted_without_tokens,
        },
        "series": {
            "t": run.series.t,
            "blocks_in_use": run.series.blocks,
            "pinned_requests": run.series.pinned_requests,
        },
        "flows": [_flow_record(flow, ev) for flow in flows],
    }


def _flow_record(flow: FlowResult, evidence: Evidence) -> dict[str, Any]:
    """One flow, plus what D's log and P's record say about it (simulators only)."""
    record: dict[str, Any] = msgspec.to_builtins(flow)
    entry = (evidence.d_log or {}).get(flow.request_id)
    record["d_origin"] = entry.get("origin") if entry else None
    record["d_admitted"] = bool(entry.get("admitted")) if entry else None
    if evidence.p_requests is not None and flow.p_request_id:
        record["p_fate"] = fate_of(evidence.p_requests.get(flow.p_request_id))
    else:
        record["p_fate"] = None
    return record


def _p_section(run: RunData) -> dict[str, Any]:
    delta = run.evidence.p_delta
    counted, sampled = delta.get("pinned_block_seconds"), run.series.block_seconds()
    ranks = None
    if run.after.notifs_per_rank is not None and run.before.notifs_per_rank is not None:
        ranks = [a - b for a, b in zip(run.after.notifs_per_rank, run.before.notifs_per_rank, strict=False)]
    return {
        "series_unit": "blocks" if run.after.blocks_total else "percent",
        "blocks_total": run.after.blocks_total,
        "peak_blocks_in_use": run.series.peak(),
        "pinned_block_seconds": round(counted if counted is not None else sampled or 0.0, 2),
        "pinned_block_seconds_source": "P's counter" if counted is not None else "sampled",
        "refused_no_blocks": delta.get("refused_no_blocks"),
        "freed_by_notification": delta.get("freed_by_notification"),
        "freed_by_expiry": delta.get("freed_by_expiry"),
        "notifs_unknown": delta.get("notifs_unknown"),
        "notifs_per_rank": ranks,
        "counters": dict(delta),
    }


def _rate(count: float, seconds: float) -> float | None:
    return round(count / seconds, 2) if seconds else None


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def render_table(report: Mapping[str, Any]) -> str:
    """A short text summary of ``build_report``'s dict."""
    outcomes, p, lat = report["requests"]["by_outcome"], report["p"], report["latency_ms"]
    names = ("ok", "rejected", "stream_rejected", "p_refused", "p_failed", "incomplete", "error")
    lines = [
        f"loadtest: {report['requests']['started']} flows in {report['elapsed_s']:.1f} s "
        f"(offered {_fmt(report['offered_rps'])}/s, {report['requests']['dropped']} dropped), P probed via "
        f"{'/stats' if report['p_probe'] == 'simulator' else '/metrics'}",
        "  outcomes     " + "  ".join(f"{name} {outcomes.get(name, 0)}" for name in names),
        f"  throughput   {_fmt(report['throughput_rps'])} completed flows/s",
        f"  latency ms   {'p50':>9} {'p90':>9} {'p99':>9} {'max':>9}",
    ]
    for name in ("ttft", "total"):
        row = lat[name]
        lines.append(f"    {name:10} " + " ".join(f"{_fmt(row[q]):>9}" for q in ("p50", "p90", "p99", "max")))
    statuses = report["rejections"]["by_status"]
    lines.append("  rejections   " + (", ".join(f"{k}: {v}" for k, v in sorted(statuses.items())) or "none"))
    releases = report["releases"]
    if releases is not None:
        shown = {k[9:]: v for k, v in releases.items() if k.startswith("releases.") and v}
        listed = ", ".join(f"{k} {v:.0f}" for k, v in sorted(shown.items()))
        lines.append("  releases     " + (listed or "none"))
    blocks = p["series_unit"] == "blocks"
    peak = (
        f"peak {_fmt(p['peak_blocks_in_use'], 0)}/{_fmt(p['blocks_total'], 0)} blocks"
        if blocks
        else f"peak {_fmt(p['peak_blocks_in_use'])}% of the KV cache"
    )
    lines.append(
        f"  P            {peak}, {p['pinned_block_seconds']:.1f} pinned {'block' if blocks else '%'}-seconds "
        f"({p['pinned_block_seconds_source']}), refused {_fmt(p['refused_no_blocks'], 0)} for lack of blocks"
    )
    lines.append(
        f"               freed by notification {_fmt(p['freed_by_notification'], 0)}, by lease expiry "
        f"{_fmt(p['freed_by_expiry'], 0)}, notifications for unknown ids {_fmt(p['notifs_unknown'], 0)}"
    )
    if report["rejected_fates"] is not None:
        fates = report["rejected_fates"]
        lines.append("  rejected     " + (", ".join(f"{k} {v}" for k, v in sorted(fates.items())) or "none"))
    lines += [f"  note: {note}" for note in report["verdict"]["notes"]]
    lines.append(report["verdict"]["line"])
    return "\n".join(lines)
