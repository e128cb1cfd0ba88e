"""``python -m tests.faults.soak`` end to end, shortened: it stops by itself, checks and reports."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.nixl, pytest.mark.slow_faults]


def test_short_soak_passes_and_reports(tmp_path: Path) -> None:
    """Expected: exit code 0; a report with every flow judged, no violation, P restarted at least
    once (``--p-restart 1``), faults injected, a flat memory verdict and the table on stdout."""
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "tests.faults.soak",
            "--requests",
            "3000",
            "--round",
            "600",
            "--p-restart",
            "1",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert (report["flows"], report["rounds"], report["violations"]) == (3000, 5, 0)
    assert report["p_restarts"] == 5
    kinds = report["totals"]["kinds"]
    assert kinds.get("reject", 0) > 0 and sum(kinds.get(k, 0) for k in ("slow", "drop", "disconnect")) > 0
    assert sum(report["totals"]["fates"].values()) == 3000
    assert report["memory"]["flat"] is True
    assert "verdict: PASS" in result.stdout
