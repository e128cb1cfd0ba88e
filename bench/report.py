"""Figures of one run, their ratios to direct, the targets, the table and the JSON.

``Report`` is what ``out/bench.json`` holds: every figure of both paths (all
positive numbers), the sidecar's own cost, the ratios and each target with
its verdict. ``render`` turns it into the table printed at the end of a run.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Literal

import msgspec

# Other processes taking more than this share of one of the benchmark's cores disturb it.
DISTURBED_SHARE = 0.1


class JsonFigures(msgspec.Struct, kw_only=True):
    """Non-streaming requests at one concurrency."""

    requests: int
    rps: float
    p50_ms: float
    p99_ms: float


class SseFigures(msgspec.Struct, kw_only=True):
    """64-event streams: time to the first body bytes, and to the end of the stream."""

    streams: int
    ttfb_p50_ms: float
    ttfb_p99_ms: float
    total_p50_ms: float
    total_p99_ms: float


class PathFigures(msgspec.Struct, kw_only=True):
    """Everything measured on one path (client -> D, or client -> sidecar -> D)."""

    json_c1: JsonFigures
    json_c32: JsonFigures
    sse: SseFigures


class SidecarCost(msgspec.Struct, kw_only=True):
    """The sidecar process's own CPU (utime + stime) and memory."""

    cpu_s_per_1k_json_c32: float
    cpu_s_per_1k_json_c1: float
    cpu_ms_per_sse_stream: float
    rss_mib: float


class OtherCpu(msgspec.Struct, kw_only=True):
    """Cores' worth of CPU that other processes took during one path's measured phases."""

    load_core: float
    sidecar_core: float


class Environment(msgspec.Struct, kw_only=True):
    """How quiet the machine was: figures taken beside other busy processes are disturbed."""

    loadavg_start: float
    loadavg_end: float
    other_cpu_direct: OtherCpu
    other_cpu_sidecar: OtherCpu
    disturbed: bool


def environment(loadavg: tuple[float, float], direct: OtherCpu, sidecar: OtherCpu) -> Environment:
    shares = (direct.load_core, direct.sidecar_core, sidecar.load_core, sidecar.sidecar_core)
    return Environment(
        loadavg_start=loadavg[0],
        loadavg_end=loadavg[1],
        other_cpu_direct=direct,
        other_cpu_sidecar=sidecar,
        disturbed=max(shares) > DISTURBED_SHARE,
    )


class Target(msgspec.Struct, kw_only=True):
    """One target: the figure it judges (a ratio key or ``cost.<field>``), the limit, the verdict."""

    figure: str
    value: float
    op: Literal["<=", ">="]
    limit: float
    unit: str
    passed: bool


class Report(msgspec.Struct, kw_only=True):
    quick: bool
    cores: str
    settings: dict[str, object]
    seconds: float
    direct: PathFigures
    sidecar: PathFigures
    cost: SidecarCost
    ratios: dict[str, float]
    targets: list[Target]
    environment: Environment
    # Measured phases stopped by their time bound before their count was done.
    stopped_early: list[str]


# (key, label, getter) for every per-path figure, in table order.
_ROWS: list[tuple[str, str, Callable[[PathFigures], float]]] = [
    ("json_c1.rps", "JSON  1 conn   req/s", lambda f: f.json_c1.rps),
    ("json_c1.p50_ms", "JSON  1 conn   p50 ms", lambda f: f.json_c1.p50_ms),
    ("json_c1.p99_ms", "JSON  1 conn   p99 ms", lambda f: f.json_c1.p99_ms),
    ("json_c32.rps", "JSON 32 conns  req/s", lambda f: f.json_c32.rps),
    ("json_c32.p50_ms", "JSON 32 conns  p50 ms", lambda f: f.json_c32.p50_ms),
    ("json_c32.p99_ms", "JSON 32 conns  p99 ms", lambda f: f.json_c32.p99_ms),
    ("sse.ttfb_p50_ms", "SSE  TTFB      p50 ms", lambda f: f.sse.ttfb_p50_ms),
    ("sse.ttfb_p99_ms", "SSE  TTFB      p99 ms", lambda f: f.sse.ttfb_p99_ms),
    ("sse.total_p50_ms", "SSE  total     p50 ms", lambda f: f.sse.total_p50_ms),
    ("sse.total_p99_ms", "SSE  total     p99 ms", lambda f: f.sse.total_p99_ms),
]


def ratios(direct: PathFigures, sidecar: PathFigures) -> dict[str, float]:
    """Sidecar over direct for every figure (req/s: higher is better; times: lower)."""
    return {key: get(sidecar) / get(direct) for key, _, get in _ROWS}


def targets(ratio: dict[str, float], cost: SidecarCost) -> list[Target]:
    """The three targets of the sidecar, judged on this run's figures."""

    def judge(figure: str, value: float, op: Literal["<=", ">="], limit: float, unit: str) -> Target:
        passed = value <= limit if op == "<=" else value >= limit
        return Target(figure=figure, value=value, op=op, limit=limit, unit=unit, passed=passed)

    return [
        judge("json_c32.rps", ratio["json_c32.rps"], ">=", 0.6, "x direct"),
        judge("cost.cpu_s_per_1k_json_c32", cost.cpu_s_per_1k_json_c32, "<=", 0.5, "s"),
        judge("sse.ttfb_p99_ms", ratio["sse.ttfb_p99_ms"], "<=", 1.2, "x direct"),
    ]


def _verdict(report: Report, figure: str) -> str:
    for target in report.targets:
        if target.figure == figure:
            mark = "PASS" if target.passed else "MISS"
            unit = "x" if target.unit == "x direct" else " s"
            return f"{target.op} {target.limit:g}{unit}  {mark}"
    return ""


def render(report: Report) -> str:
    """The table printed after a run."""
    mode = "quick" if report.quick else "full"
    rounds = report.settings.get("rounds")
    lines = [
        f"kv-release-sidecar bench ({mode}, {rounds} round(s), {report.seconds:.0f} s; {report.cores})",
        f"{'figure':<24}{'direct':>10}{'sidecar':>10}{'ratio':>9}   target",
    ]
    for key, label, get in _ROWS:
        ratio = report.ratios[key]
        lines.append(
            f"{label:<24}{get(report.direct):>10.2f}{get(report.sidecar):>10.2f}{ratio:>8.2f}x"
            f"   {_verdict(report, key)}".rstrip()
        )
    cost = report.cost
    lines += [
        f"{'proxy CPU s/1k JSON c32':<24}{'':>10}{cost.cpu_s_per_1k_json_c32:>10.3f}{'':>9}"
        f"   {_verdict(report, 'cost.cpu_s_per_1k_json_c32')}",
        f"{'proxy CPU s/1k JSON c1':<24}{'':>10}{cost.cpu_s_per_1k_json_c1:>10.3f}",
        f"{'proxy CPU ms/SSE stream':<24}{'':>10}{cost.cpu_ms_per_sse_stream:>10.3f}",
        f"{'sidecar RSS MiB':<24}{'':>10}{cost.rss_mib:>10.1f}",
    ]
    env = report.environment
    direct, sidecar = env.other_cpu_direct, env.other_cpu_sidecar
    lines.append(
        f"other processes' CPU, cores (load core / sidecar core): direct phases "
        f"{direct.load_core:.2f} / {direct.sidecar_core:.2f}, sidecar phases "
        f"{sidecar.load_core:.2f} / {sidecar.sidecar_core:.2f}; load average "
        f"{env.loadavg_start:.1f} -> {env.loadavg_end:.1f}"
    )
    if report.stopped_early:
        lines.append(f"stopped early by their time bound: {', '.join(report.stopped_early)}")
    if env.disturbed:
        lines.append("WARNING: other processes were busy on the benchmark's cores; the figures are disturbed")
    missed = [t.figure for t in report.targets if not t.passed]
    lines.append("all targets met" if not missed else f"missed: {', '.join(missed)}")
    return "\n".join(lines)


def write_json(report: Report, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(msgspec.json.format(msgspec.json.encode(report)) + b"\n")
