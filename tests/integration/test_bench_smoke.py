"""``python -m bench --quick`` runs end to end and writes every figure as a positive number.

The smoke run starts the real sim-decode and sidecar processes, so it also
checks that both answered every benchmark request correctly (the bench exits
1 otherwise). Speed is not asserted: targets depend on the machine.
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
EXPECTED = (
    {f"direct.{name}" for name in PATH_FIGURES}
    | {f"sidecar.{name}" for name in PATH_FIGURES}
    | {f"ratios.{name}" for name in RATIOS}
    | {f"cost.{name}" for name in ("cpu_s_per_1k_json_c32", "cpu_s_per_1k_json_c1", "cpu_ms_per_sse_stream")}
    | {"cost.rss_mib"}
)


def leaves(node: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """``("a.b.c", value)`` for every non-mapping value; ratio keys already contain dots."""
    if isinstance(node, dict):
        for key, value in node.items():
            yield from leaves(value, f"{prefix}.{key}" if prefix else key)
    else:
        yield prefix, node


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
        assert isinstance(value, (int, float)) and not isinstance(value, bool), name
        assert value > 0, f"{name} = {value!r}"
    assert {target["figure"] for target in report["targets"]} == {
        "json_c32.rps",
        "cost.cpu_s_per_1k_json_c32",
        "sse.ttfb_p99_ms",
    }
    assert all(isinstance(target["passed"], bool) for target in report["targets"])
