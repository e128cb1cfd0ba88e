"""Running ``python -m bench`` as the smoke tests do: a subprocess in the checkout, its JSON read back."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def run_bench(out: Path, *args: str, timeout: float = 150) -> tuple[dict[str, Any], str]:
    """``python -m bench ARGS --json OUT``; asserts it exited 0, returns the report and stdout."""
    result = subprocess.run(
        [sys.executable, "-m", "bench", *args, "--json", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report: dict[str, Any] = json.loads(out.read_text())
    return report, result.stdout
