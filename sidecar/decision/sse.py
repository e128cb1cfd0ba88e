"""Spotting an error in the first SSE event of a stream, without holding the stream.

vLLM reports a failure of its engine admission step after HTTP 200 as the
first event, ``data: {"error": {..., "code": 400}}`` (flat
``{"object": "error", ..., "code": 400}`` before 0.10.1); the scanner returns
the error's code, type and message (``sidecar.classify`` tells some 503s
apart by their exact message). The scanner sees
each chunk as it is forwarded, keeps at most ``LIMIT`` bytes until the first
event ends, and then stops looking.

On ``/v1/messages`` vLLM sends an error as Anthropic's ``error`` event,
``{"type": "error", "error": {"type", "message"}}`` without a code: a 4xx
is told by Anthropic's type names (0.33.0), anything else counts as no
code at all (never released).

A ``/v1/responses`` stream opens with ``response.created`` and
``response.in_progress`` before D's engine has the request (vLLM yields both
before the engine generator runs, ``responses/serving.py``
``responses_stream_generator``, 0.10.0-0.33.0), so on that route those lead
events are skipped and the first other event decides (``LEAD_EVENTS``). A
stream cut before one arrives is then judged as cut before its first event.
"""

from __future__ import annotations

import msgspec

from sidecar.classify import FirstEvent

LIMIT = 64 * 1024
_ANY = msgspec.json.Decoder()
# /v1/responses events sent before the engine has the request.
LEAD_EVENTS = frozenset({"response.created", "response.in_progress", "response.queued"})


class _Typed(msgspec.Struct):
    type: object = None


_TYPED = msgspec.json.Decoder(_Typed)


class FirstEventScanner:
    """Feed chunks; ``result`` is set once the first event is complete (or over the limit)."""

    __slots__ = ("_buffer", "_skip_lead", "result")

    def __init__(self, skip_lead: bool = False) -> None:
        self._buffer = b""
        self._skip_lead = skip_lead  # a /v1/responses stream: LEAD_EVENTS do not decide
        self.result: FirstEvent | None = None

    def feed(self, chunk: bytes) -> FirstEvent | None:
        if self.result is not None:
            return self.result
        self._buffer += chunk
        while True:
            end = _event_end(self._buffer)
            if end < 0:
                if len(self._buffer) > LIMIT:
                    self.result, self._buffer = FirstEvent(None, None), b""
                return self.result
            event = self._buffer[:end]
            if self._skip_lead and _is_lead(event):
                self._buffer = self._buffer[end:].lstrip(b"\r\n")
                continue
            self.result = parse_event(event)
            self._buffer = b""
            return self.result

    def finish(self) -> FirstEvent:
        """At end of stream: judge whatever arrived."""
        if self.result is None:
            self.result = parse_event(self._buffer) if self._buffer.strip() else FirstEvent(None, None)
        return self.result


def _event_end(buffer: bytes) -> int:
    ends = [i for i in (buffer.find(b"\n\n"), buffer.find(b"\r\n\r\n"), buffer.find(b"\r\r")) if i >= 0]
    return min(ends) if ends else -1


def _data(event: bytes) -> bytes:
    return b"\n".join(line[5:].lstrip(b" ") for line in event.splitlines() if line.startswith(b"data:"))


def _is_lead(event: bytes) -> bool:
    try:
        kind = _TYPED.decode(_data(event)).type
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        return False
    return isinstance(kind, str) and kind in LEAD_EVENTS


def parse_event(event: bytes) -> FirstEvent:
    """The error code and type of one SSE event, or ``FirstEvent(None, None)``."""
    data = _data(event)
    if not data or data.strip() == b"[DONE]":
        return FirstEvent(None, None)
    try:
        payload = _ANY.decode(data)
    except (msgspec.DecodeError, RecursionError):  # msgspec raises RecursionError past ~1000 levels
        return FirstEvent(None, None)
    if not isinstance(payload, dict):
        return FirstEvent(None, None)
    error = payload.get("error")
    if isinstance(error, dict):
        if payload.get("type") == "error" and "code" not in error:
            return _from_anthropic(error)
        return _from_error(error)
    if payload.get("object") == "error":
        return _from_error(payload)
    return FirstEvent(None, None)


#: The ``error.type`` names vLLM 0.33.0 gives a 4xx on ``/v1/messages`` (``translate_error_type``).
ANTHROPIC_CLIENT_ERRORS = frozenset(
    {
        "invalid_request_error",
        "authentication_error",
        "permission_error",
        "not_found_error",
        "request_too_large",
        "rate_limit_error",
    }
)


def _from_anthropic(error: dict[str, object]) -> FirstEvent:
    """A ``/v1/messages`` stream's error event (no code): one of Anthropic's 4xx names counts as
    a 4xx; any other type (``api_error``, ``overloaded_error``, or vLLM's own names before
    0.33.0, which do not say the status) has no code, so it is never released."""
    type_, message = error.get("type"), error.get("message")
    return FirstEvent(
        400 if type_ in ANTHROPIC_CLIENT_ERRORS else None,
        type_ if isinstance(type_, str) else None,
        message if isinstance(message, str) else None,
    )


def _from_error(error: dict[str, object]) -> FirstEvent:
    code, type_, message = error.get("code"), error.get("type"), error.get("message")
    if isinstance(code, str) and code.isascii() and code.isdigit() and len(code) <= 9:
        code = int(code)
    return FirstEvent(
        code if isinstance(code, int) and not isinstance(code, bool) else None,
        type_ if isinstance(type_, str) else None,
        message if isinstance(message, str) else None,
    )
