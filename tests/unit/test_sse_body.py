"""First-SSE-event scanning and the oversized-body tail scan."""

from __future__ import annotations

import json

import pytest

from sidecar.decision.sse import LIMIT, FirstEvent, FirstEventScanner, parse_event
from sidecar.proxy.context import tail_params

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


# vLLM 0.29.0-0.33.0: a stream refused by AsyncLLM._add_request's admission check.
OVERFLOW_EVENT = (
    b'data: {"error": {"message": "The engine is currently busy and cannot accept new requests. Please '
    b'try again later or on a different instance.", "type": "Service Unavailable", "param": null, '
    b'"code": 503}}\n\n'
)


def test_first_event_reports_the_message() -> None:
    first = FirstEventScanner().feed(OVERFLOW_EVENT)
    assert first == FirstEvent(
        503,
        "Service Unavailable",
        "The engine is currently busy and cannot accept new requests. "
        "Please try again later or on a different instance.",
    )
    assert parse_event(b'data: {"error": {"message": 7, "type": "t", "code": 503}}').error_message is None
    assert parse_event(ERROR_EVENT).error_message == "too long"


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


CREATED = b'event: response.created\ndata: {"type": "response.created", "response": {}}\n\n'
IN_PROGRESS = b'event: response.in_progress\ndata: {"type": "response.in_progress", "response": {}}\n\n'
ITEM = b'event: response.output_item.added\ndata: {"type": "response.output_item.added"}\n\n'


@pytest.mark.parametrize(
    ("chunks", "decided", "code"),
    [
        ([CREATED, IN_PROGRESS], False, None),  # only the lead events: nothing decided yet
        ([CREATED + IN_PROGRESS + ITEM], True, None),  # admitted: the engine produced output
        ([CREATED, IN_PROGRESS[:7], IN_PROGRESS[7:] + ERROR_EVENT], True, 400),  # split, then an error
        ([CREATED.replace(b"\n\n", b"\r\n\r\n"), ERROR_EVENT], True, 400),
        ([b'data: {"type": "error", "code": "x"}\n\n'], True, None),  # not a lead event: decides
    ],
)
def test_responses_lead_events_do_not_decide(chunks: list[bytes], decided: bool, code: int | None) -> None:
    scanner = FirstEventScanner(skip_lead=True)
    result = None
    for chunk in chunks:
        result = scanner.feed(chunk)
    assert (result is not None) == decided
    if result is not None:
        assert result.error_code == code


def test_lead_events_decide_on_other_routes() -> None:
    assert FirstEventScanner().feed(CREATED) == FirstEvent(None, None)
