"""``python -m bench.router.inproc``: a sample runs the router's real code in a fresh process."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.router import inproc as bench_router_inproc


def test_a_sample_measures_streams_through_the_router_and_both_trees_are_reported(
    capsys: pytest.CaptureFixture[str],
) -> None:
    tree = Path(__file__).resolve().parents[2]
    assert 0 < bench_router_inproc.sample(tree, 20) < 1_000_000  # µs of CPU per stream
    assert bench_router_inproc.main(["--baseline", str(tree), "--streams", "10", "--samples", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == ["sidecar", "baseline"]
    assert all("median" in line and "µs" in line for line in lines)
