"""Figures of one run, their ratios to direct, the targets, the table and the JSON.

``Report`` is what ``out/bench.json`` holds: every figure of every path (all
positive numbers), the sidecar's own cost, the ratios and each target with
its verdict. The targets judge the sidecar against the direct path only. The
reference hops (the relay, and nginx when it was measured) come with their
own ratios to direct, their own CPU and memory, and what the sidecar adds
over each for SSE time to first byte (ms, which noise can make negative, and
a ratio): the floor any hop in this layout pays, beside what the sidecar
pays. ``render`` turns it into the table printed at
the end of a run.
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
    """Everything measured on one path (client -> D, or client -> a proxy -> D)."""

    json_c1: JsonFigures
    json_c32: JsonFigures
    sse: SseFigures


class ProxyCost(msgspec.Struct, kw_only=True):
    """A proxy's own CPU (utime + stime) and memory: the sidecar's, or a reference hop's."""

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
    other_cpu_relay: OtherCpu
    other_cpu_nginx: OtherCpu | None
    disturbed: bool


def environment(loadavg: tuple[float, float], other: dict[str, OtherCpu]) -> Environment:
    """``other``: each measured path's ``OtherCpu`` (direct, sidecar, relay, and maybe nginx)."""
    shares = [share for cpu in other.values() for share in (cpu.load_core, cpu.sidecar_core)]
    return Environment(
        loadavg_start=loadavg[0],
        loadavg_end=loadavg[1],
        other_cpu_direct=other["direct"],
        other_cpu_sidecar=other["sidecar"],
        other_cpu_relay=other["relay"],
        other_cpu_nginx=other.get("nginx"),
        disturbed=max(shares) > DISTURBED_SHARE,
    )


class OverReference(msgspec.Struct, kw_only=True):
    """What the sidecar adds over a reference hop for SSE time to first byte: ms, and sidecar / hop."""

    ttfb_p50_added_ms: float
    ttfb_p50_ratio: float
    ttfb_p99_added_ms: float
    ttfb_p99_ratio: float


def over(sidecar: PathFigures, reference: PathFigures) -> OverReference:
    mine, theirs = sidecar.sse, reference.sse
    return OverReference(
        ttfb_p50_added_ms=mine.ttfb_p50_ms - theirs.ttfb_p50_ms,
        ttfb_p50_ratio=mine.ttfb_p50_ms / theirs.ttfb_p50_ms,
        ttfb_p99_added_ms=mine.ttfb_p99_ms - theirs.ttfb_p99_ms,
        ttfb_p99_ratio=mine.ttfb_p99_ms / theirs.ttfb_p99_ms,
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
    # Rounds run (the settings' rounds rounded up to a multiple of the number of paths).
    rounds: int
    paths: list[str]
    seconds: float
    direct: PathFigures
    sidecar: PathFigures
    cost: ProxyCost
    ratios: dict[str, float]
    targets: list[Target]
    environment: Environment
    # Measured phases stopped by their time bound before their count was done.
    stopped_early: list[str]
    # The reference hops: the relay always, nginx when its binary was available.
    relay: PathFigures
    nginx: PathFigures | None
    # Per reference hop: its figures over direct (as ``ratios``), its own cost, and what
    # the sidecar adds over it.
    reference_ratios: dict[str, dict[str, float]]
    reference_cost: dict[str, ProxyCost]
    sidecar_over_reference: dict[str, OverReference]

    def references(self) -> dict[str, PathFigures]:
        """The reference hops measured, by name, in table order."""
        return {"relay": self.relay} | ({"nginx": self.nginx} if self.nginx is not None else {})


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


def ratios(direct: PathFigures, other: PathFigures) -> dict[str, float]:
    """The other path (the sidecar, or a reference hop) over direct for every figure
    (req/s: higher is better; times: lower)."""
    return {key: get(other) / get(direct) for key, _, get in _ROWS}


def targets(ratio: dict[str, float], cost: ProxyCost) -> list[Target]:
    """The three targets of the sidecar, judged on this run's figures."""

    def judge(figure: str, value: float, op: Literal["<=", ">="], limit: float, unit: str) -> Target:
        passed = value <= limit if op == "<=" else value >= limit
        return Target(figure=figure, value=value, op=op, limit=limit, unit=unit, passed=passed)

    return [
        judge("json_c32.rps", ratio["json_c32.rps"], ">=", 0.6, "x direct"),
        judge("cost.cpu_s_per_1k_json_c32", cost.cpu_s_per_1k_json_c32, "<=", 0.5, "s"),
        judge("sse.ttfb_p99_ms", ratio["sse.ttfb_p99_ms"], "<=", 1.2, "x direct"),
    ]


# (cost key, label, getter) for every proxy cost row but the RSS, in table order.
_COST_ROWS: list[tuple[str, str, Callable[[ProxyCost], float]]] = [
    ("cost.cpu_s_per_1k_json_c32", "proxy CPU s/1k JSON c32", lambda c: c.cpu_s_per_1k_json_c32),
    ("cost.cpu_s_per_1k_json_c1", "proxy CPU s/1k JSON c1", lambda c: c.cpu_s_per_1k_json_c1),
    ("cost.cpu_ms_per_sse_stream", "proxy CPU ms/SSE stream", lambda c: c.cpu_ms_per_sse_stream),
]
_TARGET_WIDTH = 15  # the widest verdict, so the reference columns line up after it


def _verdict(report: Report, figure: str) -> str:
    for target in report.targets:
        if target.figure == figure:
            mark = "PASS" if target.passed else "MISS"
            unit = "x" if target.unit == "x direct" else " s"
            return f"{target.op} {target.limit:g}{unit}  {mark}"
    return ""


def render(report: Report) -> str:
    """The table printed after a run.

    The sidecar against direct with the targets, as always; then one pair of
    columns per reference hop (its figure and its ratio to direct, its own CPU
    on the cost rows); then a line per hop saying what the sidecar adds over it.
    """
    mode = "quick" if report.quick else "full"
    refs = report.references()
    lines = [
        f"kv-release-sidecar bench ({mode}, {report.rounds} round(s), {report.seconds:.0f} s;"
        f" {report.cores})",
        f"{'figure':<24}{'direct':>10}{'sidecar':>10}{'ratio':>9}   {'target':<{_TARGET_WIDTH}}"
        + "".join(f"{name:>10}{'ratio':>9}" for name in refs),
    ]
    for key, label, get in _ROWS:
        mine = (
            f"{label:<24}{get(report.direct):>10.2f}{get(report.sidecar):>10.2f}{report.ratios[key]:>8.2f}x"
        )
        theirs = "".join(
            f"{get(refs[name]):>10.2f}{report.reference_ratios[name][key]:>8.2f}x" for name in refs
        )
        lines.append(f"{mine}   {_verdict(report, key):<{_TARGET_WIDTH}}{theirs}".rstrip())
    for figure, label, cost in _COST_ROWS:
        mine = f"{label:<24}{'':>10}{cost(report.cost):>10.3f}{'':>9}"
        theirs = "".join(f"{cost(report.reference_cost[name]):>10.3f}{'':>9}" for name in refs)
        lines.append(f"{mine}   {_verdict(report, figure):<{_TARGET_WIDTH}}{theirs}".rstrip())
    lines.append(f"{'sidecar RSS MiB':<24}{'':>10}{report.cost.rss_mib:>10.1f}")
    for name in refs:
        added = report.sidecar_over_reference[name]
        lines.append(
            f"sidecar over {name}: SSE TTFB p50 {added.ttfb_p50_added_ms:+.2f} ms"
            f" ({added.ttfb_p50_ratio:.2f}x), p99 {added.ttfb_p99_added_ms:+.2f} ms"
            f" ({added.ttfb_p99_ratio:.2f}x)"
        )
    lines.append(_environment_line(report.environment))
    if report.stopped_early:
        lines.append(f"stopped early by their time bound: {', '.join(report.stopped_early)}")
    if report.environment.disturbed:
        lines.append("WARNING: other processes were busy on the benchmark's cores; the figures are disturbed")
    missed = [t.figure for t in report.targets if not t.passed]
    lines.append("all targets met" if not missed else f"missed: {', '.join(missed)}")
    return "\n".join(lines)


def _environment_line(env: Environment) -> str:
    others = {"direct": env.other_cpu_direct, "sidecar": env.other_cpu_sidecar, "relay": env.other_cpu_relay}
    if env.other_cpu_nginx is not None:
        others["nginx"] = env.other_cpu_nginx
    phases = ", ".join(
        f"{path} phases {o.load_core:.2f} / {o.sidecar_core:.2f}" for path, o in others.items()
    )
    return (
        f"other processes' CPU, cores (load core / sidecar core): {phases};"
        f" load average {env.loadavg_start:.1f} -> {env.loadavg_end:.1f}"
    )


def write_json(report: Report, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(msgspec.json.format(msgspec.json.encode(report)) + b"\n")
