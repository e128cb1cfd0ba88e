"""First-SSE-event scanning and the oversized-body tail scan."""

from __future__ import annotations

import json

import pytest

from sidecar.body import tail_params
from sidecar.sse import LIMIT, FirstEventScanner, parse_event

ERROR_EVENT = (
    b'data: {"error": {"message": "too long", "type": "BadRequestError", "param": null, "code": 400}}\n\n'
)


@pytest.mark.parametrize(
    ("chunks", "code", "type_"),
    [
        ([ERROR_EVENT, b"data: [DONE]\n\n"], 400, "BadRequestError"),
        ([ERROR_EVENT[:10], ERROR_EVENT[10:30], ERROR_EVENT[30:]], 400, "BadRequestError"),
        (
            [b'data: {"object": "error", "message": "m", "type": "t", "param": null, "code": 400}\n\n'],
            400,
            "t",
        ),
        ([b'data: {"id": "c", "choices": []}\n\n', ERROR_EVENT], None, None),  # error after the first event
        ([b'data: {"error": {"message": "x", "type": "t", "param": null, "code": 503}}\r\n\r\n'], 503, "t"),
        ([b'data: {"error": {"message": "no code"}}\n\n'], None, None),
        ([b"data: [DONE]\n\n"], None, None),
        ([b": comment\n\n"], None, None),
        ([b"data: not json\n\n"], None, None),
    ],
)
def test_first_event(chunks: list[bytes], code: int | None, type_: str | None) -> None:
    scanner = FirstEventScanner()
    result = None
    for chunk in chunks:
        result = scanner.feed(chunk)
    result = result or scanner.finish()
    assert (result.error_code, result.error_type) == (code, type_)


def test_scanner_gives_up_past_limit() -> None:
    scanner = FirstEventScanner()
    assert scanner.feed(b"data: " + b"x" * (LIMIT + 1)) is not None
    assert scanner.feed(ERROR_EVENT).error_code is None  # type: ignore[union-attr]


def test_unterminated_event_judged_at_end() -> None:
    scanner = FirstEventScanner()
    assert scanner.feed(ERROR_EVENT.rstrip()) is None
    assert scanner.finish().error_code == 400
    assert parse_event(b"").error_code is None


PARAMS = {"do_remote_prefill": True, "remote_engine_id": "e", "remote_block_ids": [1]}


def test_tail_params_finds_last_top_level_member() -> None:
    body = json.dumps({"prompt": "x" * 1000, "kv_transfer_params": PARAMS}).encode()
    assert json.loads(tail_params(body[-500:]) or b"null") == PARAMS


@pytest.mark.parametrize(
    "body",
    [
        json.dumps({"kv_transfer_params": PARAMS, "prompt": "x"}),  # not the last member
        json.dumps({"messages": [{"kv_transfer_params": PARAMS}]}),  # nested
        json.dumps({"prompt": 'say "kv_transfer_params": {}'}),  # inside a string
        '{"prompt": "x", "kv_transfer_params": {"do_remote_prefill": tr',  # cut
        '{"prompt": "x"}',
    ],
)
def test_tail_params_ignores_everything_else(body: str) -> None:
    assert tail_params(body.encode()) is None
