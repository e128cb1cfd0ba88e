"""``python -m bench.router --quick`` runs end to end and writes every figure as a positive number.

The real sim-prefill, sim-decode and both sidecars run as processes, so this
also checks that every benchmark request was answered right on both paths
(the bench exits 1 otherwise). Speed is not asserted.
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
OUT = ROOT / "out" / "bench-router-smoke.json"
CONNECTIONS = ("c1", "c8")


def test_quick_router_bench_writes_every_figure_as_a_positive_number() -> None:
    OUT.unlink(missing_ok=True)
    result = subprocess.run(
        [sys.executable, "-m", "bench.router", "--quick", "--json", str(OUT)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(OUT.read_text())
    # Quick, not full (whose bound is 40 s); start-up on a loaded machine may take a few seconds
    # beyond the quick run's own 10 s bound.
    assert report["quick"] is True
    assert report["seconds"] < 30
    figures: dict[str, object] = {}
    for path in ("router", "sidecar_only"):
        assert set(report[path]) == set(CONNECTIONS)
        for conns in CONNECTIONS:
            assert set(report[path][conns]) == {"requests", "rps", "p50_ms", "p99_ms"}
            figures |= {f"{path}.{conns}.{k}": v for k, v in report[path][conns].items()}
    assert set(report["ratios"]) == set(CONNECTIONS)
    for conns in CONNECTIONS:
        assert set(report["ratios"][conns]) == {"rps", "p50_ms", "p99_ms"}
        assert set(report["added_ms"][conns]) == {"p50_ms", "p99_ms"}  # a difference: either sign
        figures |= {f"ratios.{conns}.{k}": v for k, v in report["ratios"][conns].items()}
    for name, value in figures.items():
        assert isinstance(value, (int, float)) and not isinstance(value, bool), name
        assert value > 0, f"{name} = {value!r}"
    assert report["prefill"]["freed_by_notification"] > 0
    assert report["prefill"]["notifs_unknown"] == 0
