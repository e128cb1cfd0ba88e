"""Router mode's two bodies, route by route: what P gets capped, what D gets restored."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from sidecar.router import PREFILL_PARAMS, decode_body, prefill_body, prefill_headers, sized
from sidecar.router.bodies import with_params

MESSAGES = [{"role": "user", "content": "hi"}]
PARAMS = {"do_remote_prefill": True, "remote_engine_id": "e", "remote_block_ids": [[1]]}

# (route, client body, the fields P must see, the fields P must not see)
CASES: list[tuple[str, dict[str, Any], dict[str, Any], tuple[str, ...]]] = [
    (
        "/v1/chat/completions",
        {"messages": MESSAGES, "max_tokens": 20, "min_tokens": 10},
        {"max_tokens": 1, "min_tokens": 1},
        ("max_completion_tokens",),
    ),
    (
        "/v1/chat/completions",
        {
            "messages": MESSAGES,
            "max_completion_tokens": 20,
            "min_tokens": 5,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
        {"max_tokens": 1, "max_completion_tokens": 1, "min_tokens": 1, "stream": False},
        ("stream_options",),
    ),
    ("/v1/chat/completions", {"messages": MESSAGES}, {"max_tokens": 1}, ("min_tokens",)),
    (
        "/v1/completions",
        {"prompt": "a b", "max_tokens": 20, "min_tokens": 20},
        {"max_tokens": 1, "min_tokens": 1},
        ("max_completion_tokens",),
    ),
    (
        "/v1/messages",
        {"messages": MESSAGES, "max_tokens": 64, "min_tokens": 3, "stream": True},
        {"max_tokens": 1, "min_tokens": 1, "stream": False},
        (),
    ),
    (
        "/v1/responses",
        {"input": "hi", "max_output_tokens": 30, "stream": True},
        {"max_output_tokens": 1, "stream": False},
        ("max_tokens",),
    ),
    (
        "/inference/v1/generate",
        {"token_ids": [1, 2], "sampling_params": {"max_tokens": 20, "min_tokens": 10, "temperature": 0}},
        {"sampling_params": {"max_tokens": 1, "min_tokens": 1, "temperature": 0}},
        ("max_tokens", "min_tokens"),
    ),
    (
        "/inference/v1/generate",
        {"token_ids": [1, 2], "stream": True, "stream_options": {"include_usage": True}},
        {"sampling_params": {"max_tokens": 1}, "stream": False},
        ("stream_options",),
    ),
    (
        "/inference/v1/generate",
        {"token_ids": [1, 2], "sampling_params": None},
        {"sampling_params": {"max_tokens": 1}},
        (),
    ),
    # Not an object: left as it is, P refuses it as D would.
    ("/inference/v1/generate", {"token_ids": [1], "sampling_params": 7}, {"sampling_params": 7}, ()),
]


@pytest.mark.parametrize(("route", "request_body", "expected", "absent"), CASES)
def test_prefill_leg_caps_every_budget_field_of_its_route(
    route: str, request_body: dict[str, Any], expected: dict[str, Any], absent: tuple[str, ...]
) -> None:
    original = msgspec.json.decode(msgspec.json.encode(request_body))
    leg = msgspec.json.decode(prefill_body(request_body, route))
    assert leg["kv_transfer_params"] == PREFILL_PARAMS
    assert {k: leg.get(k) for k in expected} == expected
    assert [k for k in absent if k in leg] == []
    assert request_body == original  # the client's request is not touched (the decode leg reuses it)
    decode = msgspec.json.decode(decode_body(request_body, PARAMS))
    assert decode == {**original, "kv_transfer_params": PARAMS}  # every field as the client sent it


def test_decode_leg_without_parameters_drops_the_clients() -> None:
    body = {"prompt": "x", "kv_transfer_params": {"do_remote_prefill": True}}
    assert msgspec.json.decode(decode_body(body, None)) == {"prompt": "x"}


@pytest.mark.parametrize(
    "body",
    [
        {},
        {"prompt": "x"},
        {"messages": MESSAGES, "stream": True, "n": 1, "extra": {"nested": [1, "é", None]}},
        {"prompt": "x", "kv_transfer_params": {"do_remote_prefill": False}},  # kept in its place
    ],
)
@pytest.mark.parametrize("params", [PARAMS, {}])
def test_the_decode_body_from_the_parameters_json_is_byte_for_byte_the_same(
    body: dict[str, Any], params: dict[str, Any]
) -> None:
    assert with_params(body, msgspec.json.encode(params)) == decode_body(body, params)


def test_a_rewritten_bodys_headers_drop_the_routing_header_and_the_clients_length() -> None:
    client = [("content-length", "5"), ("x-prefiller-host-port", "p:1"), ("x-a", "1")]
    assert sized(client, b"123") == [("x-a", "1"), ("content-length", "3")]
    assert sized(prefill_headers(client), b"123") == sized(client, b"123")
