"""Answer bodies of the decode simulator, shaped like vLLM 0.33.0's.

An answer is ``stream_events`` tokens long (``"t0 t1 t2 ..."``, so a
whitespace count of the text equals ``completion_tokens``) and finishes with
``"stop"``, unless the request's output budget (``max_tokens``,
``max_completion_tokens``, ``max_output_tokens``) is smaller: then it has
that many tokens and finishes with ``"length"``. ``Answers`` encodes what
does not depend on the request once, at start-up: the per-event JSON tails
of chat and completion chunks. Per request it joins bytes and encodes the
last chunk and the small ``usage`` object, so the happy path stays cheap.
Responses API bodies live in ``decode_responses``.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec

from sidecar.sim.decode import anthropic, generate, responses
from sidecar.sim.decode.config import DecodeSimConfig
from sidecar.sim.decode.responses import Reply
from sidecar.sim.decode.rules import ParsedRequest
from sidecar.sim.decode.state import do_remote_prefill
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


def reply_for(config: DecodeSimConfig, route: str, request_id: str, request: ParsedRequest) -> Reply:
    """The answer's size: the simulator's ``stream_events`` tokens, cut to the request's
    budget (what it asked, and what the context leaves after the prompt)."""
    room = config.max_model_len - request.prompt_tokens
    budget = room if request.max_tokens is None else min(request.max_tokens, room)
    tokens = min(config.stream_events, budget)
    remote = do_remote_prefill(request.kv_transfer_params)
    return Reply(
        route=route,
        request_id=request_id,
        created=int(time.time()),
        prompt_tokens=request.prompt_tokens,
        tokens=tokens,
        finished=tokens == config.stream_events,
        cached_tokens=request.prompt_tokens if remote else 0,
        include_usage=request.include_usage,
        max_tokens=budget,
        temperature=request.temperature,
        top_p=request.top_p,
    )


class Answers:
    """Encoded answers for one config; build once, reuse for every request."""

    def __init__(self, config: DecodeSimConfig) -> None:
        count = config.stream_events
        self.details = config.prompt_tokens_details
        self.model = config.model
        self.tokens = ["t0", *(f" t{i}" for i in range(1, count))]
        self._model_json = _ENCODER.encode(config.model)
        # Every event's tail, unfinished; the last one of an answer is encoded per request.
        self._chat_tails = [_chat_tail(i, token, None) for i, token in enumerate(self.tokens)]
        self._text_tails = [_text_tail(token, None) for token in self.tokens]

    def usage(self, reply: Reply) -> dict[str, Any]:
        """vLLM's ``UsageInfo`` for ``reply``."""
        details = {"cached_tokens": reply.cached_tokens} if self.details else None
        return {
            "prompt_tokens": reply.prompt_tokens,
            "total_tokens": reply.prompt_tokens + reply.tokens,
            "completion_tokens": reply.tokens,
            "prompt_tokens_details": details,
        }

    def full(self, reply: Reply) -> bytes:
        """The non-streaming JSON answer of ``reply.route``."""
        text = "".join(self.tokens[: reply.tokens])
        if reply.route == anthropic.ROUTE:
            return anthropic.full(reply, self.model, text)
        if reply.route == generate.ROUTE:
            return generate.full(reply, self.model, self.details)
        if reply.route == "/v1/responses":
            return _ENCODER.encode(responses.response(reply, self.model, text))
        if reply.route == "/v1/chat/completions":
            choice: dict[str, Any] = {
                "index": 0,
                "message": {"role": "assistant", "content": text, "tool_calls": []},
                "logprobs": None,
                "finish_reason": reply.finish_reason,
                "stop_reason": None,
            }
            kind = "chat.completion"
        else:
            choice = {
                "index": 0,
                "text": text,
                "logprobs": None,
                "finish_reason": reply.finish_reason,
                "stop_reason": None,
            }
            kind = "text_completion"
        return _ENCODER.encode(
            {
                "id": ID_PREFIXES[reply.route] + reply.request_id,
                "object": kind,
                "created": reply.created,
                "model": self.model,
                "choices": [choice],
                "usage": self.usage(reply),
                "kv_transfer_params": None,
            }
        )

    def stream(self, reply: Reply) -> list[bytes]:
        """Every SSE event of a streamed answer, in order, ``[DONE]`` included."""
        if reply.route == "/v1/responses":
            return responses.stream(reply, self.model, self.tokens[: reply.tokens])
        if reply.route == anthropic.ROUTE:
            return anthropic.stream(reply, self.model, self.tokens[: reply.tokens])
        if reply.route == generate.ROUTE:
            return generate.stream(reply, self.model, self.details)
        chat = reply.route == "/v1/chat/completions"
        head = b"".join(
            (
                b'data: {"id":',
                _ENCODER.encode(ID_PREFIXES[reply.route] + reply.request_id),
                b',"object":"chat.completion.chunk"' if chat else b',"object":"text_completion"',
                b',"created":%d,"model":' % reply.created,
                self._model_json,
                b",",
            )
        )
        last = max(reply.tokens - 1, 0)  # an aborted answer: one event, no token
        tails = (self._chat_tails if chat else self._text_tails)[:last]
        token = self.tokens[last] if reply.tokens else ""
        tails.append(
            _chat_tail(last, token, reply.finish_reason) if chat else _text_tail(token, reply.finish_reason)
        )
        events = [head + tail for tail in tails]
        if reply.include_usage:
            usage = {k: v for k, v in self.usage(reply).items() if v is not None}
            events.append(head + b'"choices":[],"usage":' + _ENCODER.encode(usage) + b"}\n\n")
        events.append(DONE_EVENT)
        return events


def _chat_tail(index: int, token: str, finish: str | None) -> bytes:
    delta: dict[str, str] = {"role": "assistant", "content": token} if index == 0 else {"content": token}
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
    return b'"choices":' + _ENCODER.encode([choice]) + b"}\n\n"


def _text_tail(token: str, finish: str | None) -> bytes:
    choice = {"index": 0, "text": token, "logprobs": None, "finish_reason": finish, "stop_reason": None}
    return b'"choices":' + _ENCODER.encode([choice]) + b"}\n\n"
