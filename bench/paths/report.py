"""Figures of one run, per path: ratios to direct, proxy cost, CPU shares, the targets, the JSON.

``Report`` is what ``out/bench.json`` holds. Every path (direct, the sidecar,
the relay, nginx when it was measured) has the same entry: its figures, and
for the hops their ratios to direct, what they add to the SSE time to first
byte, their own CPU and memory (``ProxyCost``), and who used how much CPU in
each phase (``PhaseLoad``). The targets judge the sidecar, against direct
and against nginx, from the same run. ``bench.paths.render`` prints it as a table.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import msgspec

from bench.harness.report import Environment
from bench.paths.saturation import PhaseLoad


class JsonFigures(msgspec.Struct, kw_only=True):
    """Non-streaming requests at one concurrency."""

    requests: int
    seconds: float  # as the load generator timed its runs, summed over the rounds
    rps: float
    p50_ms: float
    p99_ms: float


class SseFigures(msgspec.Struct, kw_only=True):
    """Streams: time to the first body bytes, and to the end of the stream."""

    streams: int
    ttfb_p50_ms: float
    ttfb_p99_ms: float
    total_p50_ms: float
    total_p99_ms: float


class PathFigures(msgspec.Struct, kw_only=True):
    """Everything the load generator measured on one path (client -> D, or client -> a hop -> D)."""

    json_c1: JsonFigures
    json_c32: JsonFigures
    sse: SseFigures


class ProxyCost(msgspec.Struct, kw_only=True):
    """A hop's own CPU (utime + stime of its processes) and memory (VmRSS).

    ``cpu_ms_per_request_json_c32`` is also CPU seconds per 1,000 requests (the same
    number); ``core_rps_json_c32`` is requests per CPU second of the hop: what one core
    of it could serve. RSS is read once all servers are ready, before any load (idle),
    and as the highest reading during the JSON phases at 32 connections (under load).
    """

    cpu_ms_per_request_json_c32: float
    core_rps_json_c32: float
    cpu_ms_per_request_json_c1: float
    cpu_ms_per_sse_stream: float
    rss_idle_mb: float
    rss_load_mb: float


class AddedTtfb(msgspec.Struct, kw_only=True):
    """What a hop adds to the SSE time to first byte over direct, in ms (noise can make it negative)."""

    p50_ms: float
    p99_ms: float


class PathReport(msgspec.Struct, kw_only=True):
    """One path: figures, and for a hop its ratios to direct, added TTFB and cost; CPU per phase."""

    figures: PathFigures
    ratios: dict[str, float] | None  # None on the direct path
    ttfb_added: AddedTtfb | None
    cost: ProxyCost | None
    load: dict[str, PhaseLoad]  # by phase name


class Target(msgspec.Struct, kw_only=True):
    """One target of the sidecar: the figure it judges, the limit, the verdict (None: not judged)."""

    figure: str
    value: float
    op: Literal["<=", ">=", "<"]
    limit: float | None
    unit: str
    passed: bool | None


class Report(msgspec.Struct, kw_only=True):
    quick: bool
    cores: str
    # What generated the JSON load (wrk, or the Python fallback and why).
    json_client: str
    json_client_is_wrk: bool
    settings: dict[str, object]
    # Rounds run (the settings' rounds rounded up to a multiple of the number of paths).
    rounds: int
    paths: list[str]
    seconds: float
    results: dict[str, PathReport]
    targets: list[Target]
    # "<phase> <path>" wherever the load generator rather than the proxy saturated its core.
    client_saturated: list[str]
    environment: Environment
    # Rounds that did not run their course: an SSE phase stopped by its time bound before its
    # count was done, a JSON phase in which no request completed (the machine stalled the path).
    stopped_early: list[str]


# (key, label, getter) for every per-path figure, in table order.
ROWS: list[tuple[str, str, Callable[[PathFigures], float]]] = [
    ("json_c32.rps", "JSON 32 conns  req/s", lambda f: f.json_c32.rps),
    ("json_c32.p50_ms", "JSON 32 conns  p50 ms", lambda f: f.json_c32.p50_ms),
    ("json_c32.p99_ms", "JSON 32 conns  p99 ms", lambda f: f.json_c32.p99_ms),
    ("json_c1.rps", "JSON  1 conn   req/s", lambda f: f.json_c1.rps),
    ("json_c1.p50_ms", "JSON  1 conn   p50 ms", lambda f: f.json_c1.p50_ms),
    ("json_c1.p99_ms", "JSON  1 conn   p99 ms", lambda f: f.json_c1.p99_ms),
    ("sse.ttfb_p50_ms", "SSE  TTFB      p50 ms", lambda f: f.sse.ttfb_p50_ms),
    ("sse.ttfb_p99_ms", "SSE  TTFB      p99 ms", lambda f: f.sse.ttfb_p99_ms),
    ("sse.total_p50_ms", "SSE  total     p50 ms", lambda f: f.sse.total_p50_ms),
    ("sse.total_p99_ms", "SSE  total     p99 ms", lambda f: f.sse.total_p99_ms),
]


def ratios(direct: PathFigures, other: PathFigures) -> dict[str, float]:
    """A hop's figures over direct's (req/s: higher is better; times: lower)."""
    return {key: get(other) / get(direct) for key, _, get in ROWS}


def ttfb_added(direct: PathFigures, other: PathFigures) -> AddedTtfb:
    return AddedTtfb(
        p50_ms=other.sse.ttfb_p50_ms - direct.sse.ttfb_p50_ms,
        p99_ms=other.sse.ttfb_p99_ms - direct.sse.ttfb_p99_ms,
    )


def path_report(
    figures: PathFigures, direct: PathFigures, cost: ProxyCost | None, load: dict[str, PhaseLoad]
) -> PathReport:
    """One path's entry; a path without a cost (no hop) is the direct path itself."""
    if cost is None:
        return PathReport(figures=figures, ratios=None, ttfb_added=None, cost=None, load=load)
    return PathReport(
        figures=figures,
        ratios=ratios(direct, figures),
        ttfb_added=ttfb_added(direct, figures),
        cost=cost,
        load=load,
    )


def _judge(figure: str, value: float, op: Literal["<=", ">=", "<"], limit: float | None, unit: str) -> Target:
    passed = None
    if limit is not None:
        passed = value <= limit if op == "<=" else value >= limit if op == ">=" else value < limit
    return Target(figure=figure, value=value, op=op, limit=limit, unit=unit, passed=passed)


def targets(results: dict[str, PathReport]) -> list[Target]:
    """The sidecar's targets, judged on this run's figures (the SSE one only when nginx ran)."""
    sidecar = results["sidecar"]
    assert sidecar.cost is not None and sidecar.ratios is not None and sidecar.ttfb_added is not None
    nginx = results["nginx"].ttfb_added if "nginx" in results else None
    return [
        _judge(
            "cost.cpu_ms_per_request_json_c32", sidecar.cost.cpu_ms_per_request_json_c32, "<=", 0.10, "ms"
        ),
        _judge("ratios.json_c32.rps", sidecar.ratios["json_c32.rps"], ">=", 0.6, "x direct"),
        _judge(
            "ttfb_added.p99_ms",
            sidecar.ttfb_added.p99_ms,
            "<=",
            nginx.p99_ms if nginx else None,
            "ms, nginx's",
        ),
        _judge("cost.rss_idle_mb", sidecar.cost.rss_idle_mb, "<", 60.0, "MB"),
    ]


def client_saturated(results: dict[str, PathReport]) -> list[str]:
    """``"<phase> <path>"`` for every phase where the load generator, not the proxy, saturated."""
    return [
        f"{phase} {path}"
        for path, entry in results.items()
        for phase, load in entry.load.items()
        if load.bound == "client"
    ]
