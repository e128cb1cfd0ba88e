"""``python -m bench.tracing --quick`` runs end to end and writes every figure as a positive number.

D, the OTLP sink and both sidecars run as processes, so this also checks that
every benchmark request was answered right on all three paths (the bench
exits 1 otherwise) and that the traced sidecar's spans reached the sink by its
shutdown flush. Speed is not asserted.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

# serial: the bench loads the machine (make test runs it alone)
pytestmark = pytest.mark.serial

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "out" / "bench-tracing-smoke.json"
CONNECTIONS = ("c1", "c32")


def test_quick_tracing_bench_writes_every_figure_as_a_positive_number() -> None:
    OUT.unlink(missing_ok=True)
    result = subprocess.run(
        [sys.executable, "-m", "bench.tracing", "--quick", "--json", str(OUT)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(OUT.read_text())
    figures: dict[str, object] = {}
    for path in ("direct", "off", "on"):
        assert set(report[path]) == set(CONNECTIONS)
        for conns in CONNECTIONS:
            expected = {"requests", "rps", "p50_ms"} | ({"cpu_s_per_1k"} if path != "direct" else set())
            assert set(report[path][conns]) == expected
            figures |= {f"{path}.{conns}.{k}": v for k, v in report[path][conns].items()}
    for conns in CONNECTIONS:
        figures |= {f"ratios.{conns}.{k}": v for k, v in report["ratios"][conns].items()}
    for name, value in figures.items():
        assert isinstance(value, (int, float)) and not isinstance(value, bool), name
        assert value > 0, f"{name} = {value!r}"
    sink = report["sink"]
    assert sink["spans"] >= sink["expected_spans_at_least"] > 0
    assert report["disabled_hooks"]["ns_per_request"] >= 0
