"""``sidecar.decision.sse``: the first-event scanner never raises, keeps at most ``LIMIT`` bytes, and does
not depend on how D's stream is cut into chunks."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import example, given
from hypothesis import strategies as st

from sidecar.decision.sse import LIMIT, FirstEvent, FirstEventScanner, parse_event
from tests.property.strategies import json_values

SEPARATORS = [b"\n\n", b"\r\n\r\n", b"\r\r"]
fields = {"code": json_values, "type": json_values, "message": json_values}
error_payloads = st.one_of(
    st.fixed_dictionaries({"error": st.fixed_dictionaries(fields)}),
    st.fixed_dictionaries({"object": st.just("error"), **fields}),
    json_values,
)


@st.composite
def streams(draw: st.DrawFn) -> bytes:
    """A few SSE events (data lines, comments, odd line ends), or noise."""
    parts = []
    for payload in draw(st.lists(error_payloads, min_size=0, max_size=3)):
        prefix = draw(st.sampled_from([b"data: ", b"data:", b": comment\ndata: ", b"event: x\ndata: "]))
        parts.append(prefix + json.dumps(payload).encode() + draw(st.sampled_from(SEPARATORS)))
    parts.append(draw(st.binary(max_size=40)))
    return b"".join(parts)


def split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({min(c, len(data)) for c in cuts})
    return [data[a:b] for a, b in zip([0, *points], [*points, len(data)], strict=True)]


def scan(chunks: list[bytes]) -> FirstEvent:
    scanner = FirstEventScanner()
    for chunk in chunks:
        first = scanner.feed(chunk)
        if first is not None:
            assert scanner._buffer == b""  # done: nothing kept (private, but it is the point)
            return first
        assert len(scanner._buffer) <= LIMIT
    return scanner.finish()


@given(streams(), st.lists(st.integers(min_value=0, max_value=400), max_size=8))
@example(b'data: {"error": {"code": "\xc2\xb2", "type": "x"}}\n\n', [])
@example(b'data: {"error": {"code": "' + b"9" * 5000 + b'"}}\n\n', [3])
@example(b"data: " + b"[" * 20_000 + b"\n\n", [])
def test_first_event_does_not_depend_on_chunking(data: bytes, cuts: list[int]) -> None:
    assert scan(split(data, cuts)) == scan([data])


@given(st.lists(st.binary(max_size=9000), max_size=12))
def test_scanner_keeps_at_most_the_limit(chunks: list[bytes]) -> None:
    scanner = FirstEventScanner()
    for chunk in chunks:
        before = scanner.result
        first = scanner.feed(chunk)
        assert before is None or first is before  # decided once
        assert len(scanner._buffer) <= LIMIT
        if first is not None:
            assert scanner._buffer == b""
    assert isinstance(scanner.finish(), FirstEvent)


def test_no_event_end_within_the_limit_gives_up_and_frees_the_buffer() -> None:
    scanner = FirstEventScanner()
    assert scanner.feed(b"data: " + b"x" * LIMIT) == FirstEvent(None, None)
    assert scanner._buffer == b""
    assert scanner.feed(b'\n\ndata: {"error": {"code": 400}}\n\n') == FirstEvent(None, None)


@given(json_values, st.sampled_from(["error", "flat"]))
def test_an_int_code_is_reported_as_sent(code: Any, shape: str) -> None:
    error = {"code": code, "type": "BadRequestError"}
    payload = {"error": error} if shape == "error" else {"object": "error", **error}
    first = parse_event(b"data: " + json.dumps(payload).encode())
    if type(code) is int:
        assert first.error_code == code
    elif isinstance(code, str) and code.isascii() and code.isdigit() and len(code) <= 9:
        assert first.error_code == int(code)
    else:
        assert first.error_code is None


@given(json_values, json_values)
def test_type_and_message_are_reported_only_as_strings(type_: Any, message: Any) -> None:
    first = parse_event(
        b"data: " + json.dumps({"error": {"code": 503, "type": type_, "message": message}}).encode()
    )
    assert first.error_type == (type_ if isinstance(type_, str) else None)
    assert first.error_message == (message if isinstance(message, str) else None)
