"""P's hold without a release, by vLLM release, and the saving a release is credited with."""

from __future__ import annotations

import pytest

from sidecar.release.hold import block_seconds_saved, hold_seconds


@pytest.mark.parametrize(
    ("version", "configured", "hold"),
    [
        ("0.33.0", 0.0, 30.0),
        ("0.22.0", 0.0, 30.0),
        ("0.21.0", 0.0, 480.0),
        ("0.11.1", 0.0, 480.0),
        ("0.11.0", 0.0, 120.0),
        ("0.10.0", 0.0, 120.0),
        ("0.9.2", 0.0, 480.0),  # no deadline at all: capped so the estimate stays finite
        (None, 0.0, 30.0),  # unknown: the shortest hold, never an overstatement
        ("garbage", 0.0, 30.0),
        ("0.33.0", 90.0, 90.0),  # a P configured with another lease
    ],
)
def test_hold_by_release(version: str | None, configured: float, hold: float) -> None:
    assert hold_seconds(version, configured) == hold


def test_the_saving_is_never_negative() -> None:
    assert block_seconds_saved(10, 30.0, 0.5) == 295.0
    assert block_seconds_saved(10, 30.0, 45.0) == 0.0
