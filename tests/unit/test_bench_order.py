"""``python -m bench``'s round order: every path takes every position equally often."""

from __future__ import annotations

from collections import Counter

import pytest

from bench.harness.rounds import order
from bench.paths.launch import PathName
from bench.paths.run import phases
from bench.paths.settings import FULL, QUICK, Settings

PATHS: tuple[PathName, ...] = ("direct", "sidecar", "relay", "nginx")


@pytest.mark.parametrize("paths", [3, 4])
def test_each_path_takes_each_position_equally_often(paths: int) -> None:
    measured = PATHS[:paths]
    rounds = FULL.rounds_for(paths)
    assert rounds >= FULL.rounds and rounds % paths == 0
    orders = [order(measured, round_) for round_ in range(rounds)]
    assert all(sorted(each) == sorted(measured) for each in orders)
    assert orders[0] == list(measured)
    assert [each[0] for each in orders[:paths]] == list(measured)  # round r starts at path r mod N
    positions = Counter((path, each.index(path)) for each in orders for path in each)
    assert set(positions.values()) == {rounds // paths}


@pytest.mark.parametrize("paths", [3, 4])
def test_a_smoke_run_of_one_round_measures_every_path_once(paths: int) -> None:
    assert QUICK.rounds_for(paths) == 1
    assert order(PATHS[:paths], 0) == list(PATHS[:paths])


def test_time_and_counts_are_per_path_and_split_over_the_rounds() -> None:
    for rounds in (6, 8):
        per_round = {phase.name: phase for phase in phases(FULL, rounds)}
        assert per_round["json_c32"].seconds * rounds == pytest.approx(FULL.json_c32_seconds)
        assert per_round["json_c1"].seconds * rounds == pytest.approx(FULL.json_c1_seconds)
        assert per_round["sse"].count * rounds >= FULL.sse_streams
        assert (per_round["sse"].count - 1) * rounds < FULL.sse_streams


@pytest.mark.parametrize("settings", [FULL, QUICK], ids=["full", "quick"])
def test_phases_run_json_before_sse_with_their_concurrency(settings: Settings) -> None:
    measured = phases(settings, settings.rounds_for(4))
    assert [(p.name, p.kind, p.concurrency) for p in measured] == [
        ("json_c32", "json", 32),
        ("json_c1", "json", 1),
        ("sse", "sse", settings.sse_concurrency),
    ]
    assert all(p.seconds > 0 and p.count == 0 for p in measured if p.kind == "json")
