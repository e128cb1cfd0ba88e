"""``/v1/messages`` answers of the decode simulator, shaped like vLLM 0.33.0's Anthropic server.

vLLM converts the request to a chat completion, runs its chat handler and
converts the answer back (``entrypoints/anthropic/serving.py``): a
``message`` body, or the ``message_start`` ... ``message_stop`` event
stream. Errors of the handler are sent in Anthropic's envelope,
``{"type": "error", "error": {"type", "message"}}``, typed by status
(``translate_error_type``); the route's body validation answers before
the handler in OpenAI's shape, as on every route.
"""

from __future__ import annotations

from typing import Any

import msgspec

from sidecar.sim.decode.responses import Reply

_ENCODER = msgspec.json.Encoder()
ROUTE = "/v1/messages"

#: 0.33.0 ``_ANTHROPIC_ERROR_TYPE_BY_STATUS`` (other 4xx: invalid_request_error, 5xx: api_error).
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def error_type(status: int) -> str:
    """``translate_error_type``: Anthropic's name for ``status``."""
    return ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")


def error_body(message: str, status: int) -> bytes:
    """``AnthropicErrorResponse`` for a handler error of ``status``."""
    return _ENCODER.encode({"type": "error", "error": {"type": error_type(status), "message": message}})


def error_event(message: str, status: int) -> bytes:
    """The stream's ``error`` event (what ``message_stream_converter`` yields on a failure)."""
    data = _ENCODER.encode({"type": "error", "error": {"type": error_type(status), "message": message}})
    return b"event: error\ndata: " + data + b"\n\n"


def _usage(reply: Reply) -> dict[str, Any]:
    # vLLM: input_tokens = prompt_tokens - cached tokens (cache fields set when details are on)
    return {
        "input_tokens": reply.prompt_tokens - reply.cached_tokens,
        "output_tokens": reply.tokens,
        "cache_read_input_tokens": reply.cached_tokens,
    }


def _stop_reason(reply: Reply) -> str:
    return "end_turn" if reply.finished else "max_tokens"


def full(reply: Reply, model: str, text: str) -> bytes:
    """The non-streaming ``message`` answer (``exclude_none``)."""
    body = {
        "id": f"chatcmpl-{reply.request_id}",
        "type": "message",
        "role": "assistant",
        "content": [{"type": "text", "text": text}],
        "model": model,
        "stop_reason": _stop_reason(reply),
        "usage": _usage(reply),
    }
    return _ENCODER.encode(body)


def _event(kind: str, fields: dict[str, Any]) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + _ENCODER.encode({"type": kind, **fields}) + b"\n\n"


def stream(reply: Reply, model: str, deltas: list[str]) -> list[bytes]:
    """Every event of a streamed answer made of ``deltas``."""
    start: dict[str, Any] = {
        "id": f"chatcmpl-{reply.request_id}",
        "type": "message",
        "role": "assistant",
        "content": [],
        "model": model,
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {"input_tokens": reply.prompt_tokens, "output_tokens": 0},
    }
    events = [_event("message_start", {"message": start})]
    events.append(_event("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}}))
    for delta in deltas:
        events.append(
            _event("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": delta}})
        )
    events.append(_event("content_block_stop", {"index": 0}))
    stop = {"delta": {"stop_reason": _stop_reason(reply)}, "usage": _usage(reply)}
    events.append(_event("message_delta", stop))
    events.append(_event("message_stop", {}))
    return events
