"""What router mode reads of P's answer to the prefill leg: its parameters and cached tokens."""

from __future__ import annotations

import json
from typing import Any

import pytest

from sidecar.router.pool import RouterError, _prefill_result

PARAMS = {"do_remote_prefill": True, "remote_engine_id": "p", "remote_block_ids": [[7, 8]]}
CHOICES = [{"index": 0, "text": "x", "logprobs": None, "finish_reason": "length"}]


def _usage(details: Any, key: str = "prompt_tokens_details") -> dict[str, Any]:
    return {"prompt_tokens": 9, key: details}


@pytest.mark.parametrize(
    ("answer", "params", "cached"),
    [
        (
            {"choices": CHOICES, "usage": _usage({"cached_tokens": 4}), "kv_transfer_params": PARAMS},
            PARAMS,
            4,
        ),
        (
            {"usage": _usage({"cached_tokens": 5}, "input_tokens_details"), "kv_transfer_params": PARAMS},
            PARAMS,
            5,
        ),
        ({"choices": CHOICES, "kv_transfer_params": None}, None, 0),
        ({"kv_transfer_params": [1, 2], "usage": "none"}, None, 0),  # not an object: P kept nothing usable
        ({"kv_transfer_params": PARAMS, "usage": _usage({"cached_tokens": "4"})}, PARAMS, 0),
        ({"kv_transfer_params": PARAMS, "usage": _usage(None)}, PARAMS, 0),
        ({}, None, 0),
    ],
)
def test_p_answer_gives_its_parameters_and_cached_tokens(answer: Any, params: Any, cached: int) -> None:
    result = _prefill_result("http://p:1", json.dumps(answer).encode())
    assert (result.params, result.cached_tokens) == (params, cached)


def test_the_last_of_repeated_members_counts_as_json_readers_take_it() -> None:
    answer = b'{"kv_transfer_params": {"a": 1}, "usage": null, "kv_transfer_params": {"b": 2}}'
    assert _prefill_result("http://p:1", answer).params == {"b": 2}


@pytest.mark.parametrize(
    ("answer", "says"),
    [
        (b"[1]", "answered a non-object"),
        (b'"text"', "answered a non-object"),
        (b"null", "answered a non-object"),
        (b"{", "answered invalid JSON"),
        (b'{"choices": [1,, 2], "kv_transfer_params": {}}', "answered invalid JSON"),  # even where unread
        (b'{"kv_transfer_params": {}} trailing', "answered invalid JSON"),
    ],
)
def test_an_answer_that_is_no_json_object_is_a_502(answer: bytes, says: str) -> None:
    with pytest.raises(RouterError) as caught:
        _prefill_result("http://p:1", answer)
    assert caught.value.status == 502 and says in str(caught.value)
