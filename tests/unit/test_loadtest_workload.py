"""The load generator's pure parts: prompt lengths, both legs' bodies, plans, arrivals."""

from __future__ import annotations

import random
from typing import Any

import pytest

from sidecar.loadtest.config import LoadConfig
from sidecar.loadtest.driver import arrival_times
from sidecar.loadtest.flow import count_blocks, error_info, p_internal_id
from sidecar.loadtest.workload import (
    Kind,
    Workload,
    client_body,
    decode_body,
    plain_workload,
    prefill_body,
    prompt_words,
)

CONFIG = LoadConfig(prefill_url="http://p:1", decode_url="http://d:2", rate=10, seed=4, api_key="k")


def test_prompt_lengths_include_very_short_and_exact_block_multiples() -> None:
    rng = random.Random(1)
    lengths = [prompt_words(rng, 16, 512) for _ in range(3000)]
    assert min(lengths) >= 1 and max(lengths) <= 512
    assert sum(n <= 3 for n in lengths) > 300  # ~15% very short
    assert sum(n % 16 == 0 for n in lengths) > 750  # ~25% exact multiples, and some by chance
    assert len({n for n in lengths if n % 16 == 0}) >= 8  # 1..8 blocks at least
    assert sum(n > 128 for n in lengths) > 100  # a long tail


@pytest.mark.parametrize("max_prompt", [1, 2, 15, 16])
def test_prompt_lengths_respect_a_tiny_cap(max_prompt: int) -> None:
    rng = random.Random(2)
    assert all(1 <= prompt_words(rng, 16, max_prompt) <= max_prompt for _ in range(500))


@pytest.mark.parametrize("route", ["completions", "chat"])
@pytest.mark.parametrize("stream", [False, True])
def test_prefill_leg_is_the_reference_proxys(route: str, stream: bool) -> None:
    body = client_body(route, "m", "hello world", 32, stream)
    original = dict(body)
    leg = prefill_body(body, route)
    assert body == original  # the client's body is left alone
    assert leg["stream"] is False and leg["max_tokens"] == 1
    assert "stream_options" not in leg
    assert leg["kv_transfer_params"] == {"do_remote_decode": True, "do_remote_prefill": False}
    assert (leg.get("max_completion_tokens") == 1) is (route == "chat")
    assert leg["model"] == "m"
    assert ("messages" in leg) is (route == "chat") and ("prompt" in leg) is (route == "completions")


def test_decode_leg_is_the_clients_body_plus_ps_params() -> None:
    body = client_body("chat", "m", "hi", 8, True)
    params = {"do_remote_prefill": True, "remote_block_ids": [[1, 2]]}
    leg = decode_body(body, params)
    assert leg == {**body, "kv_transfer_params": params}
    assert leg["stream"] is True and leg["stream_options"] == {"include_usage": True}


def test_plans_are_reproducible_per_index() -> None:
    workload = plain_workload()
    first = workload.plan(CONFIG, "m", "run", 7)
    again = workload.plan(CONFIG, "m", "other-run", 7)
    assert first.body == again.body and first.prompt_words == again.prompt_words
    assert first.request_id == "run-000007"
    assert workload.plan(CONFIG, "m", "run", 8).body != first.body
    assert first.prefill_headers == {"Authorization": "Bearer k"} == first.decode_headers


def test_kinds_edit_the_body_and_the_decode_leg() -> None:
    kind = Kind(
        "odd",
        edit=lambda body, rng: {**body, "model": "other"},
        words=lambda rng: 5,
        stream=True,
        decode_url="http://down:9",
        decode_headers={"Authorization": "Bearer wrong"},
    )
    plan = Workload([kind]).plan(CONFIG, "m", "run", 0)
    assert plan.body["model"] == "other" and plan.prompt_words == 5 and plan.stream
    assert plan.decode_url == "http://down:9"
    assert plan.decode_headers == {"Authorization": "Bearer wrong"}
    assert plan.prefill_headers == {"Authorization": "Bearer k"}


def test_workload_needs_a_positive_weight() -> None:
    with pytest.raises(ValueError):
        Workload([Kind("none", weight=0)])


def test_arrivals_are_bounded_by_duration_and_count() -> None:
    times = arrival_times(100.0, 10.0, 0, seed=1)
    assert all(0 < t <= 10.0 for t in times) and times == sorted(times)
    assert 900 < len(times) < 1100  # Poisson: about rate x duration
    assert len(arrival_times(100.0, 10.0, 25, seed=1)) == 25
    assert arrival_times(100.0, 10.0, 0, seed=1) == times  # seeded


@pytest.mark.parametrize(
    ("params", "path", "expected"),
    [
        ({"remote_request_id": "cmpl-x-0-ab12cd34"}, "/v1/completions", "cmpl-x-0-ab12cd34"),
        ({}, "/v1/completions", "cmpl-req-0"),
        ({}, "/v1/chat/completions", "chatcmpl-req"),
    ],
)
def test_p_internal_id(params: dict[str, Any], path: str, expected: str) -> None:
    assert p_internal_id(params, path, "req") == expected


@pytest.mark.parametrize(
    ("ids", "blocks"), [([1, 2, 3], 3), ([[1, 2], [3, 4, 5]], 3), ([], 0), (None, 0), ([[]], 0)]
)
def test_count_blocks(ids: Any, blocks: int) -> None:
    assert count_blocks(ids) == blocks


@pytest.mark.parametrize(
    ("body", "expected_type"),
    [
        (
            b'{"error": {"message": "m", "type": "BadRequestError", "param": null, "code": 400}}',
            "BadRequestError",
        ),
        (b'{"object": "error", "message": "m", "type": "NotFoundError", "code": 404}', "NotFoundError"),
        (b'{"error": "Unauthorized"}', None),
        (b'{"detail": "Not Found"}', None),
        (b"not json", None),
    ],
)
def test_error_info(body: bytes, expected_type: str | None) -> None:
    assert error_info(body)[0] == expected_type
