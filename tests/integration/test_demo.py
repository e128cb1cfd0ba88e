"""``kv-release-sidecar demo`` runs end to end and every release decision is the expected one."""

from __future__ import annotations

import subprocess
import sys


def test_demo_exits_0_and_reports_releases() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "sidecar", "demo"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "every decision as expected" in result.stdout
    assert "stream_admission_error" in result.stdout and "unreachable" in result.stdout
