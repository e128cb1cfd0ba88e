"""``python -m bench.storm --quick`` runs end to end and writes every figure as a positive number.

The smoke run starts the real sim-prefill (real NIXL agents), sim-decode and
sidecar processes, so it also checks that every storm request was a 400, every
other request a 200, and that the sidecar's releases reached P (the bench
exits 1 otherwise). Speed is not asserted: it depends on the machine.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

# serial: the bench loads the machine (make test runs it alone)
pytestmark = [pytest.mark.nixl, pytest.mark.serial]

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "out" / "bench-storm-smoke.json"

LOAD = {"requests", "rps", "p50_ms", "p99_ms", "sidecar_cpu_cores"}
RATE = {"requests", "seconds", "rps"}
RATIOS = {f"{phase}.{name}" for phase in ("storm", "no_release") for name in ("rps", "p50_ms", "p99_ms")}
RELEASES = {
    "p_confirmed",
    "p_confirmed_per_s",
    "sidecar_sent",
    "sidecar_sent_per_s",
    "p_confirmed_total",
    "latency_p50_ms",
    "latency_p99_ms",
}
FIGURES = (
    {f"{phase}.{name}" for phase in ("baseline", "storm", "storm_no_release") for name in LOAD}
    | {f"ratios.{name}" for name in RATIOS}
    | {f"{storm}.{name}" for storm in ("storm_rate", "no_release_storm_rate") for name in RATE}
    | {f"releases.{name}" for name in RELEASES}
)
COUNTS = {
    "dropped",
    "failed",
    "refused",
    "other_results",
    "backlog_at_storm_end",
    "drain_seconds",
    "unconfirmed_after_drain",
    "stranded_on_p",
    "unused_params",
}


def leaves(node: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """``("a.b.c", value)`` for every non-mapping value; ratio keys already contain dots."""
    if isinstance(node, dict):
        for key, value in node.items():
            yield from leaves(value, f"{prefix}.{key}" if prefix else key)
    else:
        yield prefix, node


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def test_quick_storm_bench_writes_every_figure_and_p_confirms_releases() -> None:
    OUT.unlink(missing_ok=True)
    result = subprocess.run(
        [sys.executable, "-m", "bench.storm", "--quick", "--json", str(OUT)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=100,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(OUT.read_text())
    figures = dict(leaves(report["figures"]))
    assert set(figures) == FIGURES
    for name, value in figures.items():
        assert is_number(value), name
        assert value > 0, f"{name} = {value!r}"
    counts = report["counts"]
    assert set(counts) == COUNTS
    for name, value in counts.items():
        assert is_number(value), name
        assert value >= 0, f"{name} = {value!r}"
    # P itself saw releases during the storm: freed_by_notification went up.
    assert figures["releases.p_confirmed"] > 0
    assert figures["releases.p_confirmed_total"] >= figures["releases.p_confirmed"]
    assert isinstance(report["environment"]["disturbed"], bool)
