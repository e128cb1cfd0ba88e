"""PNG plots over time, for one run or several: P's pinned KV blocks, P's refusals, latency.

Drawn with matplotlib's object API on an Agg canvas (no pyplot, no global
backend switch, no display needed); matplotlib is imported only when a plot
is written, so the rest of the CLI stays light.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

COLOURS = ("#c0392b", "#2471a3", "#27ae60", "#8e44ad")


@dataclass(frozen=True)
class PlotRun:
    """One run's series: P's blocks in use over time, when P refused flows, each completed
    flow's latency."""

    label: str
    t: Sequence[float]
    blocks: Sequence[float | None]
    starts: Sequence[float]  # seconds since the start of the run
    totals_ms: Sequence[float]
    ttfts_ms: Sequence[float | None]
    refusals: Sequence[float] = ()  # start of each flow P refused (503: no free KV blocks)


def run_from_report(label: str, report: Mapping[str, Any]) -> PlotRun:
    """A ``PlotRun`` from a ``build_report`` dict (latency of completed flows only)."""
    ok = [flow for flow in report["flows"] if flow["outcome"] == "ok"]
    return PlotRun(
        label=label,
        t=report["series"]["t"],
        blocks=report["series"]["blocks_in_use"],
        starts=[flow["start"] for flow in ok],
        totals_ms=[flow["total"] * 1000 for flow in ok],
        ttfts_ms=[flow["ttft"] * 1000 if flow["ttft"] is not None else None for flow in ok],
        refusals=sorted(flow["start"] for flow in report["flows"] if flow["outcome"] == "p_refused"),
    )


def write_plot(
    path: str | Path, runs: Sequence[PlotRun], capacity: float | None, title: str, latency: bool = True
) -> Path:
    """Panels sharing the time axis: pinned blocks (with P's pool size), P's refusals so far,
    and, with ``latency``, each completed flow's latency."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    figure = Figure(figsize=(10, 9 if latency else 7), layout="constrained")
    FigureCanvasAgg(figure)
    top, middle, *rest = figure.subplots(3 if latency else 2, 1, sharex=True)
    for run, colour in zip(runs, COLOURS, strict=False):
        points = [(t, b) for t, b in zip(run.t, run.blocks, strict=True) if b is not None]
        top.step([t for t, _ in points], [b for _, b in points], where="post", color=colour, label=run.label)
        end = max([*run.t, *run.refusals], default=0.0)
        counts = list(range(len(run.refusals) + 1))
        middle.step(
            [0.0, *run.refusals, end], [*counts, counts[-1]], where="post", color=colour, label=run.label
        )
    _labels(top, middle, capacity, title)
    if rest:
        _latency(rest[0], runs)
    figure.savefig(target, dpi=100)
    return target


def _labels(top: Any, middle: Any, capacity: float | None, title: str) -> None:
    if capacity:
        label = f"P's pool ({capacity:.0f} blocks)"
        top.axhline(capacity, color="grey", linestyle="--", linewidth=1, label=label)
    top.set_ylabel("P's KV blocks in use" if capacity else "P's KV cache in use (%)")
    top.set_title(title)
    top.legend(loc="upper left")
    top.grid(alpha=0.3)
    middle.set_ylabel("P's refusals so far\n(503: no free KV blocks)")
    middle.set_xlabel("seconds since the run started")
    middle.legend(loc="upper left")
    middle.grid(alpha=0.3)


def _latency(bottom: Any, runs: Sequence[PlotRun]) -> None:
    for run, colour in zip(runs, COLOURS, strict=False):
        bottom.scatter(run.starts, run.totals_ms, s=8, color=colour, alpha=0.6, label=f"{run.label}: total")
        ttft = [(s, v) for s, v in zip(run.starts, run.ttfts_ms, strict=True) if v is not None]
        bottom.scatter(
            [s for s, _ in ttft],
            [v for _, v in ttft],
            s=8,
            marker="x",
            color=colour,
            alpha=0.4,
            label=f"{run.label}: TTFT",
        )
    bottom.set_ylabel("latency (ms), by start time")
    bottom.set_xlabel("seconds since the run started")
    bottom.legend(loc="upper left", fontsize="small")
    bottom.grid(alpha=0.3)
