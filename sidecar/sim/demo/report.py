"""The demo's side-by-side report: two runs' measurements as a table, why they differ, checks.

``figures`` reads the numbers the table shows out of one run's load-test
report (plus the releases the D-down sidecar sent); ``render`` prints a
headline (what releases changed for P), both runs side by side (the
releases the sidecar sent, the blocks they named and the pinned
block-seconds the sidecar estimates they saved, beside what P measured),
why the runs' rejection counts differ, then, per rejection cause, who frees
P's blocks without the sidecar and how P actually freed them in each run;
``problems`` lists
what would make the demo exit non-zero: a failed verdict (a wrong or double
release, an admitted request without its tokens), a rejected request the
sidecar left to P's lease, or no saving in pinned block-seconds.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sidecar.loadtest.flow import REJECTED
from sidecar.sim.demo.workload import cause_of, freed_without_sidecar

Report = Mapping[str, Any]


@dataclass(frozen=True)
class DemoRun:
    """One of the two runs: its label, release strategy and load-test report."""

    label: str
    release: str
    report: Report
    down_releases: Mapping[str, float]  # counters of the sidecar whose D is down


def _rejected(report: Report) -> list[Mapping[str, Any]]:
    return [flow for flow in report["flows"] if flow["outcome"] in REJECTED]


def figures(run: DemoRun) -> dict[str, Any]:
    """The numbers of one run the table shows (also written to the JSON report)."""
    report, p = run.report, run.report["p"]
    counted = ("releases.", "released_blocks", "block_seconds_saved")
    releases = Counter({k: v for k, v in (report["releases"] or {}).items() if k.startswith(counted)})
    releases.update({k: v for k, v in run.down_releases.items() if k.startswith(counted)})
    fates = Counter(flow["p_fate"] for flow in _rejected(report))
    outcomes, latency = report["requests"]["by_outcome"], report["latency_ms"]
    return {
        "requests": report["requests"]["started"],
        "decoded": outcomes.get("ok", 0),
        "refused_by_p": outcomes.get("p_refused", 0),
        "rejected": report["rejections"]["total"],
        "by_cause": dict(Counter(cause_of(flow) for flow in _rejected(report))),
        "releases_sent": releases.get("releases.sent", 0.0),
        "left_to_d": releases.get("releases.covered_by_engine", 0.0),
        "released_blocks": releases.get("released_blocks", 0.0),
        "block_seconds_saved_estimate": releases.get("block_seconds_saved", 0.0),
        "release_failures": releases.get("releases.failed", 0.0) + releases.get("releases.refused", 0.0),
        "p_freed_by_notification": p["freed_by_notification"],
        "p_freed_by_expiry": p["freed_by_expiry"],
        "rejected_freed_by_notification": fates.get("freed_by_notification", 0),
        "rejected_freed_by_expiry": fates.get("freed_by_expiry", 0),
        "peak_blocks": p["peak_blocks_in_use"],
        "blocks_total": p["blocks_total"],
        "pinned_block_seconds": p["pinned_block_seconds"],
        "p_refused_no_blocks": p["refused_no_blocks"],
        "latency_p50_ms": latency["total"]["p50"],
        "latency_p99_ms": latency["total"]["p99"],
        "ttft_p50_ms": latency["ttft"]["p50"],
        "ttft_p99_ms": latency["ttft"]["p99"],
        "unknown_notifications": p["notifs_unknown"],
        "verdict": "PASS" if report["verdict"]["ok"] else "FAIL",
    }


def _num(value: Any, digits: int = 0) -> str:
    if value is None:
        return "-"
    return f"{value:,.{digits}f}" if isinstance(value, float) else f"{value:,}"


def _pair(a: Any, b: Any) -> str:
    return f"{_num(a)} / {_num(b)}"


WIDTH = 56


def headline(off: Mapping[str, Any], on: Mapping[str, Any]) -> str:
    """What releases changed for P, in one line, from the two runs' figures."""
    before, after = off["pinned_block_seconds"], on["pinned_block_seconds"]
    change = f"{(after - before) / before:+.0%}".replace("%", " %") if before else "n/a"
    refusals = f"{_num(off['p_refused_no_blocks'])} -> {_num(on['p_refused_no_blocks'])}"
    return f"with releases on: P's pinned block-seconds {change}, P's refusals for lack of blocks {refusals}"


def render(runs: Sequence[DemoRun], version: str) -> str:
    """The headline, both runs side by side, then who frees what, per rejection cause."""
    off, on = figures(runs[0]), figures(runs[1])
    head = f"{'':{WIDTH}} {runs[0].label:>16} {runs[1].label:>20}"
    lines = [headline(off, on), "", head, "-" * len(head)]
    lines += [f"{label:{WIDTH}} {a:>16} {b:>20}" for label, a, b in _rows(off, on)]
    lines += ["", *_why_rejections_differ(off, on)]
    return "\n".join([*lines, "", *_who_frees(runs, version)])


def _rows(off: Mapping[str, Any], on: Mapping[str, Any]) -> list[tuple[str, str, str]]:
    rows: list[tuple[str, str, str]] = [
        ("requests (P->D flows)", *_two(off, on, "requests")),
        ("  decoded, every token received", *_two(off, on, "decoded")),
        ("  refused by P: no free KV blocks (503)", *_two(off, on, "refused_by_p")),
        ("  rejected by D or on the way to it", *_two(off, on, "rejected")),
    ]
    for cause in sorted(set(off["by_cause"]) | set(on["by_cause"])):
        rows.append((f"    {cause}", _num(off["by_cause"].get(cause, 0)), _num(on["by_cause"].get(cause, 0))))
    saved = off["pinned_block_seconds"] - on["pinned_block_seconds"]
    rows += [
        ("releases sent by the sidecar", *_two(off, on, "releases_sent")),
        ("  P's blocks they named (kvr_released_blocks_total)", *_two(off, on, "released_blocks")),
        ("  block-seconds saved, the sidecar's estimate", *_two(off, on, "block_seconds_saved_estimate")),
        ("rejections left to D's own fix (covered_by_engine)", *_two(off, on, "left_to_d")),
        ("P: requests freed by a notification (confirmed)", *_two(off, on, "p_freed_by_notification")),
        ("  of them rejected requests", *_two(off, on, "rejected_freed_by_notification")),
        ("P: rejected requests freed only by lease expiry", *_two(off, on, "rejected_freed_by_expiry")),
        (f"P: blocks pinned at peak (pool {_num(off['blocks_total'])})", *_two(off, on, "peak_blocks")),
        ("P: pinned block-seconds, measured", *_two(off, on, "pinned_block_seconds", 1)),
        ("  saved, measured (off - on)", "", _num(saved, 1)),
        ("P: requests refused for lack of blocks", *_two(off, on, "p_refused_no_blocks")),
        ("latency of decoded requests, p50 / p99 (ms)", *_lat(off, on, "latency")),
        ("time to first token, p50 / p99 (ms)", *_lat(off, on, "ttft")),
        ("wrong releases (P notified for ids it no longer held)", *_two(off, on, "unknown_notifications")),
        ("verdict", off["verdict"], on["verdict"]),
    ]
    return rows


def _why_rejections_differ(off: Mapping[str, Any], on: Mapping[str, Any]) -> list[str]:
    lines = []
    if off["refused_by_p"] > on["refused_by_p"]:
        lines.append(
            f"Why more rejections with releases on: with them off, P refused {_num(off['refused_by_p'])} "
            "requests for lack of blocks,\nso those never reached D to be rejected there."
        )
    if on["releases_sent"]:
        lines.append(
            "The sidecar's estimate counts each request it released for P's whole lease; P's measurement "
            "is\nthe whole run's, so it also sees requests that got blocks only because others were freed."
        )
    return lines


def _two(off: Mapping[str, Any], on: Mapping[str, Any], key: str, digits: int = 0) -> tuple[str, str]:
    return _num(off[key], digits), _num(on[key], digits)


def _lat(off: Mapping[str, Any], on: Mapping[str, Any], key: str) -> tuple[str, str]:
    return _pair(off[f"{key}_p50_ms"], off[f"{key}_p99_ms"]), _pair(on[f"{key}_p50_ms"], on[f"{key}_p99_ms"])


def _who_frees(runs: Sequence[DemoRun], version: str) -> list[str]:
    """Per cause: who frees P's blocks without the sidecar, and the measured fates per run."""
    origins: dict[str, str | None] = {}
    fates: dict[str, dict[str, Counter[str]]] = defaultdict(lambda: defaultdict(Counter))
    for run in runs:
        for flow in _rejected(run.report):
            cause = cause_of(flow)
            origins.setdefault(cause, flow["d_origin"])
            fates[cause][run.release][flow["p_fate"]] += 1
    width = WIDTH
    lines = [
        f"who frees P's blocks for a rejected request (vLLM {version}; counts: notified / lease-expired)",
        f"{'cause':{width}} {'without the sidecar':>22} {runs[0].label:>14} {runs[1].label:>20}",
    ]
    for cause in sorted(fates):
        counts = [fates[cause][run.release] for run in runs]
        cells = [f"{c['freed_by_notification']} / {c['freed_by_expiry']}" for c in counts]
        who = freed_without_sidecar(origins[cause], version)
        lines.append(f"{cause:{width}} {who:>22} {cells[0]:>14} {cells[1]:>20}")
    return lines


def problems(runs: Sequence[DemoRun]) -> list[str]:
    """What makes the demo exit 1 (see the module docstring)."""
    found = [
        f"{run.label}: {run.report['verdict']['line']}" for run in runs if not run.report["verdict"]["ok"]
    ]
    off, on = figures(runs[0]), figures(runs[1])
    if on["rejected_freed_by_expiry"]:
        found.append(
            f"{runs[1].label}: {on['rejected_freed_by_expiry']} rejected request(s) waited for P's lease"
        )
    if not on["pinned_block_seconds"] < off["pinned_block_seconds"]:
        found.append("releases on did not lower P's pinned block-seconds")
    return found
