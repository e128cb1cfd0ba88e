"""Answer bodies of the decode simulator, shaped like vLLM 0.33.0's.

Every answer is ``stream_events`` tokens long (``"t0 t1 t2 ..."``, so a
whitespace count of the text equals ``completion_tokens``) and finishes with
``"stop"``. ``Answers`` encodes everything that does not depend on the
request once, at start-up: the per-event JSON tails of chat and completion
chunks and the response-API deltas. Per request it only joins bytes and
encodes the small ``usage`` object, so the happy path stays cheap.
"""

from __future__ import annotations

from typing import Any

import msgspec

from sidecar.sim.decode_config import DecodeSimConfig
from sidecar.wire import error_body

_ENCODER = msgspec.json.Encoder()
DONE_EVENT = b"data: [DONE]\n\n"

#: Prefix of the ``id`` vLLM gives an answer, by route (followed by the x-request-id).
ID_PREFIXES = {
    "/v1/chat/completions": "chatcmpl-",
    "/v1/completions": "cmpl-",
    "/v1/responses": "resp_",
}


def sse_error_event(message: str, status: int, type_: str) -> bytes:
    """vLLM's in-band stream failure: ``data: {"error": {...}}`` (``param`` is null)."""
    return b"data: " + error_body(message, status, type_) + b"\n\n"


class Answers:
    """Encoded answers for one config; build once, reuse for every request."""

    def __init__(self, config: DecodeSimConfig) -> None:
        count = config.stream_events
        self.completion_tokens = count
        self.details = config.prompt_tokens_details
        self.model = config.served_model
        tokens = ["t0", *(f" t{i}" for i in range(1, count))]
        self.text = "".join(tokens)
        self._model_json = _ENCODER.encode(config.served_model)
        self._deltas = [_ENCODER.encode(token) for token in tokens]
        self._chat_tails = [_chat_tail(i, token, count) for i, token in enumerate(tokens)]
        self._text_tails = [_text_tail(token, i == count - 1) for i, token in enumerate(tokens)]

    def usage(self, prompt_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
        """vLLM's ``UsageInfo`` for an answer to a prompt of this length.

        ``cached_tokens``: a vLLM D counts the tokens it received from P as cached.
        """
        details = {"cached_tokens": cached_tokens} if self.details else None
        return {
            "prompt_tokens": prompt_tokens,
            "total_tokens": prompt_tokens + self.completion_tokens,
            "completion_tokens": self.completion_tokens,
            "prompt_tokens_details": details,
        }

    def full(
        self, route: str, request_id: str, created: int, prompt_tokens: int, cached_tokens: int = 0
    ) -> bytes:
        """The non-streaming JSON answer of ``route``."""
        answer_id = ID_PREFIXES[route] + request_id
        if route == "/v1/responses":
            return _ENCODER.encode(self._response(answer_id, request_id, created, prompt_tokens))
        if route == "/v1/chat/completions":
            choice: dict[str, Any] = {
                "index": 0,
                "message": {"role": "assistant", "content": self.text, "tool_calls": []},
                "logprobs": None,
                "finish_reason": "stop",
                "stop_reason": None,
            }
            kind = "chat.completion"
        else:
            choice = {
                "index": 0,
                "text": self.text,
                "logprobs": None,
                "finish_reason": "stop",
                "stop_reason": None,
            }
            kind = "text_completion"
        return _ENCODER.encode(
            {
                "id": answer_id,
                "object": kind,
                "created": created,
                "model": self.model,
                "choices": [choice],
                "usage": self.usage(prompt_tokens, cached_tokens),
                "kv_transfer_params": None,
            }
        )

    def stream(
        self,
        route: str,
        request_id: str,
        created: int,
        prompt_tokens: int,
        include_usage: bool,
        cached_tokens: int = 0,
    ) -> list[bytes]:
        """Every SSE event of a streamed answer, in order, ``[DONE]`` included."""
        if route == "/v1/responses":
            return self._response_events(request_id, created, prompt_tokens)
        chat = route == "/v1/chat/completions"
        head = b"".join(
            (
                b'data: {"id":',
                _ENCODER.encode(ID_PREFIXES[route] + request_id),
                b',"object":"chat.completion.chunk"' if chat else b',"object":"text_completion"',
                b',"created":%d,"model":' % created,
                self._model_json,
                b",",
            )
        )
        events = [head + tail for tail in (self._chat_tails if chat else self._text_tails)]
        if include_usage:
            usage = {k: v for k, v in self.usage(prompt_tokens, cached_tokens).items() if v is not None}
            events.append(head + b'"choices":[],"usage":' + _ENCODER.encode(usage) + b"}\n\n")
        events.append(DONE_EVENT)
        return events

    def _response(self, answer_id: str, request_id: str, created: int, prompt_tokens: int) -> dict[str, Any]:
        content: dict[str, Any] = {
            "type": "output_text",
            "text": self.text,
            "annotations": [],
            "logprobs": None,
        }
        message = {
            "id": f"msg_{request_id}",
            "type": "message",
            "role": "assistant",
            "status": "completed",
            "content": [content],
        }
        return {
            "id": answer_id,
            "object": "response",
            "created_at": created,
            "model": self.model,
            "status": "completed",
            "output": [message],
            "usage": {
                "input_tokens": prompt_tokens,
                "input_tokens_details": {"cached_tokens": 0},
                "output_tokens": self.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": prompt_tokens + self.completion_tokens,
            },
        }

    def _response_events(self, request_id: str, created: int, prompt_tokens: int) -> list[bytes]:
        """``response.created``, ``response.in_progress``, one delta per token,
        ``response.completed``; the Responses API ends without ``[DONE]``."""
        answer_id = ID_PREFIXES["/v1/responses"] + request_id
        final = self._response(answer_id, request_id, created, prompt_tokens)
        started = {**final, "status": "in_progress", "output": [], "usage": None}
        item_id = _ENCODER.encode(f"msg_{request_id}")
        events = [
            _typed_event("response.created", 0, {"response": started}),
            _typed_event("response.in_progress", 1, {"response": started}),
        ]
        for number, delta in enumerate(self._deltas, start=2):
            events.append(
                b"event: response.output_text.delta\ndata: "
                b'{"type":"response.output_text.delta","sequence_number":%d,"item_id":'
                % number
                + item_id
                + b',"output_index":0,"content_index":0,"delta":'
                + delta
                + b',"logprobs":[]}\n\n'
            )
        events.append(_typed_event("response.completed", len(events), {"response": final}))
        return events


def _typed_event(type_: str, number: int, fields: dict[str, Any]) -> bytes:
    data = _ENCODER.encode({"type": type_, "sequence_number": number, **fields})
    return b"event: " + type_.encode() + b"\ndata: " + data + b"\n\n"


def _chat_tail(index: int, token: str, count: int) -> bytes:
    delta: dict[str, str] = {"role": "assistant", "content": token} if index == 0 else {"content": token}
    choice = {
        "index": 0,
        "delta": delta,
        "logprobs": None,
        "finish_reason": "stop" if index == count - 1 else None,
    }
    return b'"choices":' + _ENCODER.encode([choice]) + b"}\n\n"


def _text_tail(token: str, last: bool) -> bytes:
    choice = {
        "index": 0,
        "text": token,
        "logprobs": None,
        "finish_reason": "stop" if last else None,
        "stop_reason": None,
    }
    return b'"choices":' + _ENCODER.encode([choice]) + b"}\n\n"
