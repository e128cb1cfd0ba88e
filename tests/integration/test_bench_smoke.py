"""``python -m bench --quick`` runs end to end and writes every figure as a positive number.

The smoke run starts the real sim-decode, sidecar and relay processes (and
nginx when the machine has it; it is not required), so it also checks that
every one answered every benchmark request correctly (the bench exits 1
otherwise). Speed is not asserted: targets depend on the machine.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "out" / "bench-smoke.json"

PATH_FIGURES = {
    "json_c1.requests",
    "json_c1.rps",
    "json_c1.p50_ms",
    "json_c1.p99_ms",
    "json_c32.requests",
    "json_c32.rps",
    "json_c32.p50_ms",
    "json_c32.p99_ms",
    "sse.streams",
    "sse.ttfb_p50_ms",
    "sse.ttfb_p99_ms",
    "sse.total_p50_ms",
    "sse.total_p99_ms",
}
RATIOS = {name for name in PATH_FIGURES if not name.endswith(("requests", "streams"))}
COST = {"cpu_s_per_1k_json_c32", "cpu_s_per_1k_json_c1", "cpu_ms_per_sse_stream", "rss_mib"}
EXPECTED = (
    {f"direct.{name}" for name in PATH_FIGURES}
    | {f"sidecar.{name}" for name in PATH_FIGURES}
    | {f"ratios.{name}" for name in RATIOS}
    | {f"cost.{name}" for name in COST}
)
OVER = {"ttfb_p50_added_ms", "ttfb_p50_ratio", "ttfb_p99_added_ms", "ttfb_p99_ratio"}


def reference_figures(name: str) -> set[str]:
    """Every figure a reference hop gets: its own, its ratios to direct, what the sidecar adds over it."""
    return (
        {f"{name}.{figure}" for figure in PATH_FIGURES}
        | {f"reference_ratios.{name}.{ratio}" for ratio in RATIOS}
        | {f"reference_cost.{name}.{cost}" for cost in COST}
        | {f"sidecar_over_reference.{name}.{over}" for over in OVER}
    )


def leaves(node: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """``("a.b.c", value)`` for every non-mapping value; ratio keys already contain dots."""
    if isinstance(node, dict):
        for key, value in node.items():
            yield from leaves(value, f"{prefix}.{key}" if prefix else key)
    else:
        yield prefix, node


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def test_quick_bench_writes_every_figure_as_a_positive_number() -> None:
    OUT.unlink(missing_ok=True)
    result = subprocess.run(
        [sys.executable, "-m", "bench", "--quick", "--json", str(OUT)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=100,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(OUT.read_text())
    figures = dict(leaves({key: report[key] for key in ("direct", "sidecar", "ratios", "cost")}))
    assert set(figures) == EXPECTED
    for name, value in figures.items():
        assert is_number(value), name
        assert value > 0, f"{name} = {value!r}"

    # The reference hops: the relay always, nginx only where its binary is installed.
    references = ["relay"] + (["nginx"] if report["nginx"] is not None else [])
    assert report["paths"] == ["direct", "sidecar", *references]
    assert report["rounds"] % len(report["paths"]) == 0
    keys = ("reference_ratios", "reference_cost", "sidecar_over_reference")
    measured = dict(leaves({key: report[key] for key in (*references, *keys)}))
    assert set(measured) == set().union(*(reference_figures(name) for name in references))
    for name, value in measured.items():
        assert is_number(value), name
        if name.startswith("reference_cost."):  # a reference hop's CPU in a phase this short may be 0 ticks
            assert value >= 0, f"{name} = {value!r}"
        elif not name.endswith("_added_ms"):  # what the sidecar adds over a hop can be below 0
            assert value > 0, f"{name} = {value!r}"
    assert {target["figure"] for target in report["targets"]} == {
        "json_c32.rps",
        "cost.cpu_s_per_1k_json_c32",
        "sse.ttfb_p99_ms",
    }
    assert all(isinstance(target["passed"], bool) for target in report["targets"])
