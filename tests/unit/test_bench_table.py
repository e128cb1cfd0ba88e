"""``python -m bench.table`` runs and prints one line per table, with ratios to one process's."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.table import run as bench_table
from sidecar.release import shared


def test_the_table_bench_measures_every_table_it_names(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench_table.main(["--requests", "50", "--rounds", "2", "--against", shared.__file__]) == 0
    lines = capsys.readouterr().out.splitlines()
    names = [line[:28].strip() for line in lines[1:]]
    assert names == ["one process", "shared (this tree)", f"shared ({Path(shared.__file__).name})"]
    first = lines[1].split()
    assert first[-1] == first[-3] == "1.00"  # one process against itself
    assert all(float(cell) > 0 for line in lines[1:] for cell in line[28:].split())
