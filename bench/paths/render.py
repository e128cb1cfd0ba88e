"""The table printed after a run of ``python -m bench``.

One column per path: direct's figures, then each hop's figure with its ratio
to direct; the sidecar's targets in the last column, with PASS, MISS, or
``n/a`` when a target could not be judged (the SSE one without nginx). Below
the figures: each hop's own cost, the CPU each process used per phase and
what saturated, then warnings (the load generator saturated, other
processes busy on the benchmark's cores) and the verdicts.
"""

from __future__ import annotations

from collections.abc import Callable

from bench.paths.report import ROWS, PathReport, ProxyCost, Report, Target

_LABEL = 26
_CELL = 18
_PHASES = {"json_c32": "JSON 32 conns", "json_c1": "JSON  1 conn", "sse": "SSE"}

# (target figure or "", label, getter, format) for every row of a hop's own cost.
_COST_ROWS: list[tuple[str, str, Callable[[ProxyCost], float], str]] = [
    (
        "cost.cpu_ms_per_request_json_c32",
        "CPU ms/req c32 (s/1k req)",
        lambda c: c.cpu_ms_per_request_json_c32,
        ".3f",
    ),
    ("", "core req/s c32 (per CPU s)", lambda c: c.core_rps_json_c32, ".0f"),
    ("", "CPU ms/req c1", lambda c: c.cpu_ms_per_request_json_c1, ".3f"),
    ("", "CPU ms/SSE stream", lambda c: c.cpu_ms_per_sse_stream, ".3f"),
    ("cost.rss_idle_mb", "RSS idle MB", lambda c: c.rss_idle_mb, ".1f"),
    ("", "RSS under load MB", lambda c: c.rss_load_mb, ".1f"),
]


def render(report: Report) -> str:
    """The whole table and the lines after it."""
    mode = "quick" if report.quick else "full"
    paths = report.paths
    lines = [
        f"kv-release-sidecar bench ({mode}, {report.rounds} round(s), {report.seconds:.0f} s;"
        f" {report.cores})",
        f"JSON load generator: {report.json_client}",
        f"{'figure':<{_LABEL}}" + "".join(f"{path:>{_CELL}}" for path in paths) + "   sidecar target",
    ]
    for key, label, get in ROWS:
        cells = [
            _cell(f"{get(e.figures):.2f}", e.ratios[key] if e.ratios else None) for e in _entries(report)
        ]
        lines.append(_row(label, cells, _verdict(report.targets, f"ratios.{key}")))
    for which in ("p50", "p99"):
        cells = [
            _cell(f"{getattr(e.ttfb_added, f'{which}_ms'):+.2f}" if e.ttfb_added else "")
            for e in _entries(report)
        ]
        lines.append(
            _row(f"SSE  TTFB {which} added ms", cells, _verdict(report.targets, f"ttfb_added.{which}_ms"))
        )
    for figure, label, cost, form in _COST_ROWS:
        cells = [_cell(format(cost(e.cost), form) if e.cost else "") for e in _entries(report)]
        lines.append(_row(f"hop {label}", cells, _verdict(report.targets, figure)))
    for phase, name in _PHASES.items():
        lines.append(_row(f"{name} CPU cl/D/hop", [_shares(e, phase) for e in _entries(report)], ""))
        lines.append(_row(f"{name} saturated", [_cell(e.load[phase].bound) for e in _entries(report)], ""))
    lines += _saturation_lines(report)
    lines += _environment_lines(report)
    lines.append(_summary(report.targets))
    return "\n".join(line.rstrip() for line in lines)


def _entries(report: Report) -> list[PathReport]:
    return [report.results[path] for path in report.paths]


def _cell(value: str, ratio: float | None = None) -> str:
    text = value if ratio is None else f"{value} {ratio:5.2f}x"
    return f"{text:>{_CELL}}"


def _shares(entry: PathReport, phase: str) -> str:
    load = entry.load[phase]
    hop = f"{load.proxy:.2f}" if entry.cost else "-"
    return _cell(f"{load.client:.2f}/{load.decode:.2f}/{hop}")


def _row(label: str, cells: list[str], verdict: str) -> str:
    return f"{label:<{_LABEL}}{''.join(cells)}   {verdict}"


def _verdict(targets: list[Target], figure: str) -> str:
    for target in targets:
        if target.figure == figure:
            if target.limit is None or target.passed is None:
                return f"{target.op} {target.unit}: n/a (not measured)"
            mark = "PASS" if target.passed else "MISS"
            return f"{target.op} {target.limit:.3g} {target.unit}  {mark}"
    return ""


def _saturation_lines(report: Report) -> list[str]:
    if report.client_saturated:
        return [
            "WARNING: the load generator, not the hop, hit 100 % of its core in: "
            + ", ".join(report.client_saturated)
            + ". Those req/s (and ratios to them) measure the client; the hop's CPU per request"
            " and core req/s do not depend on it."
        ]
    peak = max(entry.load["json_c32"].client for entry in report.results.values())
    return [f"the load generator never saturated its core (JSON 32 conns: at most {peak:.2f} of it)"]


def _environment_lines(report: Report) -> list[str]:
    env = report.environment
    others = ", ".join(f"{path} {o.load_core:.2f}/{o.sidecar_core:.2f}" for path, o in env.other_cpu.items())
    lines = [
        f"other processes' CPU (load core / hop core) during each path's phases: {others};"
        f" load average {env.loadavg_start:.1f} -> {env.loadavg_end:.1f}"
    ]
    if report.stopped_early:
        lines.append(f"rounds that did not run their course: {', '.join(report.stopped_early)}")
    if env.disturbed:
        lines.append("WARNING: other processes were busy on the benchmark's cores; the figures are disturbed")
    return lines


def _summary(targets: list[Target]) -> str:
    missed = [t.figure for t in targets if t.passed is False]
    unjudged = [t.figure for t in targets if t.passed is None]
    met = sum(1 for t in targets if t.passed)
    text = f"sidecar targets: {met} of {len(targets)} met"
    if missed:
        text += f"; missed: {', '.join(missed)}"
    if unjudged:
        text += f"; not judged: {', '.join(unjudged)}"
    return text
