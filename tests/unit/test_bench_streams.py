"""The many-streams workload's pure parts: request templates, the timeline, what counts as busy."""

from __future__ import annotations

import os

import msgspec
import pytest

from bench.harness.noise import busiest, wait_quiet
from bench.harness.procs import CorePlan
from bench.servers.fakes import prefill_refusal
from bench.streams.cstreams import timeline
from bench.streams.run import VLLM_ROUTER_PATHS, bodies


def test_each_mode_and_path_gets_the_request_its_hop_expects() -> None:
    sidecar, none = bodies("sidecar", "sidecar", 64)
    assert none == b"" and b'"remote_request_id":"@ID@"' in sidecar  # a request id per stream
    routed, none = bodies("router", "sidecar", 64)
    assert none == b"" and b"kv_transfer_params" not in routed  # the router makes its own
    stream, prefill = bodies("router", "nginx", 64)
    assert stream.endswith(b'"kv_transfer_params":@PARAMS@}')  # P's object goes in whole
    leg = msgspec.json.decode(prefill)
    assert leg["stream"] is False and leg["max_tokens"] == 1 and prefill_refusal(prefill) is None
    assert leg["kv_transfer_params"]["do_remote_decode"] is True  # what a router asks of P
    for path in VLLM_ROUTER_PATHS:  # one request: vllm-router runs both legs
        assert bodies("router", path, 64) == (routed, b"")
    filled = msgspec.json.decode(stream.replace(b"@PARAMS@", b'{"remote_request_id": "r"}'))
    assert filled["stream"] is True and filled["kv_transfer_params"] == {"remote_request_id": "r"}


def test_the_timeline_buckets_streams_by_the_second_they_started() -> None:
    starts = [0.1, 0.5, 0.9, 1.2, 2.99, 3.5]  # the last past the window: counted in the last second
    ttfts = [0.001, 0.002, 0.003, 0.010, 0.020, 0.030]
    rows = timeline(starts, ttfts, 3.0)
    assert [count for count, _, _ in rows] == [3, 1, 2]
    assert rows[0][1] == pytest.approx(2.0) and rows[1] == (1, pytest.approx(10.0), pytest.approx(10.0))
    assert timeline([], [], 2.0) == [(0, 0.0, 0.0), (0, 0.0, 0.0)]


def test_busiest_leaves_out_the_benchmarks_own_processes_and_idle_ones() -> None:
    before = {1: ("a", 10.0), 2: ("b", 5.0), 3: ("ours", 1.0), 4: ("idle", 7.0)}
    after = {1: ("a", 10.5), 2: ("b", 7.0), 3: ("ours", 3.0), 4: ("idle", 7.0), 5: ("new", 1.0)}
    assert busiest(before, after, 2.0, exclude={3}) == [("b 2", 1.0), ("a 1", 0.25)]


async def test_waiting_for_quiet_ends_at_a_quiet_second_or_at_its_bound() -> None:
    plan = CorePlan(frozenset({0}), frozenset({1}))
    waited, others = await wait_quiet(plan, lambda: 0.0, threshold=100.0, bound=60.0)
    # the first second already counts as quiet; ``others`` is cores' worth of CPU the machine's other
    # processes used in it, sampled over about a second: at most the core count, with sampling jitter
    assert 1.0 <= waited < 5 and 0 <= others <= 1.1 * (os.cpu_count() or 1)
    waited, others = await wait_quiet(plan, lambda: 0.0, threshold=-1.0, bound=1.5)
    assert 1.5 <= waited < 5  # never quiet enough: given up at the bound, one reading past it
