"""``python -m bench``'s round order: every path takes every position equally often."""

from __future__ import annotations

from collections import Counter

import pytest

from bench.procs import PathName
from bench.run import order, phases
from bench.settings import FULL, QUICK, Settings

PATHS: tuple[PathName, ...] = ("direct", "sidecar", "relay", "nginx")


@pytest.mark.parametrize("settings", [FULL, QUICK], ids=["full", "quick"])
@pytest.mark.parametrize("paths", [3, 4])
def test_each_path_takes_each_position_equally_often(settings: Settings, paths: int) -> None:
    measured = PATHS[:paths]
    rounds = settings.rounds_for(paths)
    assert rounds >= settings.rounds and rounds % paths == 0
    orders = [order(measured, round_) for round_ in range(rounds)]
    assert all(sorted(each) == sorted(measured) for each in orders)
    assert orders[0] == list(measured)
    assert [each[0] for each in orders[:paths]] == list(measured)  # round r starts at path r mod N
    positions = Counter((path, each.index(path)) for each in orders for path in each)
    assert set(positions.values()) == {rounds // paths}


def test_counts_are_per_path_and_split_over_the_rounds() -> None:
    for rounds in (6, 8):
        per_round = {phase.name: phase.count for phase in phases(FULL, rounds)}
        assert per_round["json_c1"] * rounds >= FULL.json_c1_requests
        assert per_round["sse"] * rounds >= FULL.sse_streams
        assert (per_round["sse"] - 1) * rounds < FULL.sse_streams
