"""``/inference/v1/generate`` answers of the decode simulator (vLLM 0.33.0's token-in route).

The request carries ``token_ids`` and ``sampling_params`` (``max_tokens``
inside them; ``kv_transfer_params`` at the top level, which the server
moves into ``sampling_params.extra_args``). The answer is
``GenerateTokensResponse`` (``output_mode: "tokens"``): token ids, no
text. The route's handler (``ServingTokens.serve_tokens``) is not wrapped by
vLLM's rejection cleanup, so D never notifies P of a rejection here.
"""

from __future__ import annotations

from typing import Any

import msgspec

from sidecar.sim.decode.responses import Reply

_ENCODER = msgspec.json.Encoder()
ROUTE = "/inference/v1/generate"
DONE_EVENT = b"data: [DONE]\n\n"


def _usage(reply: Reply, details: bool) -> dict[str, Any]:
    return {
        "prompt_tokens": reply.prompt_tokens,
        "total_tokens": reply.prompt_tokens + reply.tokens,
        "completion_tokens": reply.tokens,
        "prompt_tokens_details": {"cached_tokens": reply.cached_tokens} if details else None,
    }


def full(reply: Reply, model: str, details: bool) -> bytes:
    """The non-streaming answer."""
    choice = {
        "index": 0,
        "finish_reason": reply.finish_reason,
        "stop_reason": None,
        "token_ids": list(range(100, 100 + reply.tokens)),
    }
    body = {
        "request_id": f"generate-tokens-{reply.request_id}",
        "model": model,
        "created": reply.created,
        "usage": _usage(reply, details),
        "kv_transfer_params": None,
        "output_mode": "tokens",
        "choices": [choice],
    }
    return _ENCODER.encode(body)


def stream(reply: Reply, model: str, details: bool) -> list[bytes]:
    """One event per token, the last with its finish reason (and usage when asked), then [DONE]."""
    events = []
    for index in range(max(reply.tokens, 1)):
        last = index == max(reply.tokens, 1) - 1
        choice = {
            "index": 0,
            "finish_reason": reply.finish_reason if last else None,
            "token_ids": [100 + index] if reply.tokens else [],
        }
        chunk: dict[str, Any] = {
            "request_id": f"generate-tokens-{reply.request_id}",
            "model": model,
            "created": reply.created,
            "output_mode": "tokens",
            "choices": [choice],
        }
        if last and reply.include_usage:
            chunk["usage"] = _usage(reply, details)
        events.append(b"data: " + _ENCODER.encode(chunk) + b"\n\n")
    events.append(DONE_EVENT)
    return events
