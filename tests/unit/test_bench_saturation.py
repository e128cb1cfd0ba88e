"""What saturated during a phase, from each process's share of its core."""

from __future__ import annotations

import pytest

from bench.paths.saturation import SATURATED, Bound, bound, phase_load


@pytest.mark.parametrize(
    ("client", "decode", "proxy", "other", "expected"),
    [
        (0.15, 0.45, 0.99, (0.0, 0.0), "proxy"),  # wrk, the hop's core full: what the bench is for
        (0.20, 0.78, 0.40, (0.0, 0.0), "decode"),  # wrk, direct-like: D fills the load core
        (0.55, 0.43, 0.60, (0.0, 0.0), "client"),  # the Python client takes most of a full load core
        (0.97, 0.00, 0.00, (0.0, 0.0), "client"),  # the client alone took a core
        (0.30, 0.30, 0.50, (0.0, 0.0), "none"),  # nothing full: latency-bound
        (0.25, 0.25, 0.30, (0.0, 0.70), "other"),  # someone else filled the hop's core
        (0.20, 0.30, 0.30, (0.50, 0.0), "other"),  # someone else took most of a full load core
        (0.20, 0.30, 0.60, (0.0, 0.40), "proxy"),  # the hop had the larger share of its full core
        (0.30, 0.65, 0.00, (0.0, 0.95), "decode"),  # direct: no hop, so the hop core's noise is not ours
    ],
)
def test_bound_names_the_largest_user_of_a_full_core(
    client: float, decode: float, proxy: float, other: tuple[float, float], expected: Bound
) -> None:
    assert bound(client, decode, proxy, other) == expected


def test_shares_are_cpu_seconds_over_wall_seconds() -> None:
    load = phase_load((0.5, 1.5, 1.96), (0.1, 0.0), 2.0)
    assert (load.client, load.decode, load.proxy) == (0.25, 0.75, 0.98)
    assert (load.other_load, load.other_hop) == (0.1, 0.0)
    assert load.proxy >= SATURATED and load.bound == "proxy"


def test_a_phase_without_wall_time_saturated_nothing() -> None:
    assert phase_load((1.0, 1.0, 1.0), (0.0, 0.0), 0.0).bound == "none"
