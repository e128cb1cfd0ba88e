"""``params_at_end``: P's parameters read from the last bytes of an answer over the router's limit."""

from __future__ import annotations

import json
from typing import Any

import pytest

from sidecar.router.pool import TAIL_BYTES, params_at_end

PARAMS = {
    "do_remote_prefill": True,
    "remote_engine_id": "p",
    "remote_request_id": "cmpl-1",
    "remote_block_ids": [[7]],
}


def answer(*, indent: int | None = None, **members: Any) -> bytes:
    """A vLLM answer with a large member before its parameters, as JSON (``indent``: with spaces)."""
    body: dict[str, Any] = {"id": "cmpl-1", "prompt_logprobs": [{"9": {"decoded_token": "x"}}] * 2000}
    body.update({"kv_transfer_params": PARAMS, **members})
    return json.dumps(body, indent=indent, ensure_ascii=False).encode()  # UTF-8, as Starlette writes


@pytest.mark.parametrize(
    "data",
    [
        answer(),
        answer(ec_transfer_params=None, metrics=None),  # vLLM's members after them
        answer(indent=2, metrics={"queued": 0.1}),  # whitespace anywhere
        # the token-in generate route's: its one-token choices after them
        answer(ec_transfer_params=None, output_mode="tokens", choices=[{"index": 0, "token_ids": [5]}]),
        answer(prompt_text='say "kv_transfer_params": {} then'),  # the key's text inside a string
    ],
)
def test_the_answers_own_parameters_are_found_in_its_tail(data: bytes) -> None:
    assert params_at_end(data[-4096:]) == PARAMS


@pytest.mark.parametrize(
    ("data", "why"),
    [
        (answer(kv_transfer_params=None), "P kept nothing"),
        (answer(kv_transfer_params=None, metrics={"kv_transfer_params": PARAMS}), "nested in a member"),
        (answer(kv_transfer_params=[PARAMS]), "not an object"),
        (answer()[:-1], "the answer did not end"),
        (answer() + b"}", "more closing braces than the answer opened"),
        (answer(metrics={"a": 1})[:-3] + b"}", "what follows is not the rest of the object"),
        (json.dumps({"wrapper": {"kv_transfer_params": PARAMS}}).encode(), "one level down"),
        (answer()[: -len(json.dumps(PARAMS)) - 2] + b"}", "the value was cut"),
    ],
)
def test_anything_else_is_none(data: bytes, why: str) -> None:
    assert params_at_end(data[-4096:]) is None, why


def test_a_tail_cut_inside_a_multibyte_character_still_reads() -> None:
    body = {"prompt_text": "é" * 3000, "kv_transfer_params": PARAMS}  # the text before them
    data = json.dumps(body, ensure_ascii=False).encode()
    cut = data[data.index(b"\xc3") + 1 :]  # starts with a lone continuation byte
    assert cut[:1] == b"\xa9" and params_at_end(cut) == PARAMS


def test_the_tail_holds_a_long_prompts_block_ids() -> None:
    ids = list(range(100_000, 231_072))  # 131,072 six-digit ids, 16 times a 131,072-token prompt's
    data = answer(kv_transfer_params={**PARAMS, "remote_block_ids": [ids]})
    found = params_at_end(data[-TAIL_BYTES:])
    assert found is not None and found["remote_block_ids"] == [ids]
