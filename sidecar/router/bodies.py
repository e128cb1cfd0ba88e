"""Router mode's bodies: the prefill leg's, the decode leg's, and D's answer corrected on the way out.

The prefill leg is vLLM's reference P/D proxy's: the same body with
``stream: false``, the output budget set to 1 (``max_tokens``;
``max_completion_tokens`` for chat; ``max_output_tokens`` for responses),
``stream_options`` removed and ``kv_transfer_params`` asking P to keep the
blocks for a remote decode. The decode leg is the original body plus the
``kv_transfer_params`` P returned. ``UsageRewriter`` reports P's cached
tokens in D's answer (D got the whole prompt from P).
"""

from __future__ import annotations

from typing import Any

import msgspec

_DECODER = msgspec.json.Decoder()
_ENCODER = msgspec.json.Encoder()

# What the prefill leg asks of P (vLLM's toy_proxy_server / disagg proxy).
PREFILL_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


def prefill_body(request: dict[str, Any], route: str) -> bytes:
    """The prefill leg's body: same prompt, no stream, an output budget of one token."""
    body = dict(request)
    body["stream"] = False
    body.pop("stream_options", None)
    if route == "/v1/responses":
        body["max_output_tokens"] = 1
    else:
        body["max_tokens"] = 1
        if route == "/v1/chat/completions" and "max_completion_tokens" in body:
            body["max_completion_tokens"] = 1
    body["kv_transfer_params"] = dict(PREFILL_PARAMS)
    return _ENCODER.encode(body)


def decode_body(request: dict[str, Any], params: dict[str, Any] | None) -> bytes:
    """The decode leg's body: the original request plus P's kv_transfer_params."""
    body = dict(request)
    if params is None:
        body.pop("kv_transfer_params", None)
    else:
        body["kv_transfer_params"] = params
    return _ENCODER.encode(body)


def prefill_headers(headers: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """Client headers for P: the same, minus the length (the body changes) and the routing header."""
    return [(n, v) for n, v in headers if n not in ("content-length", "x-prefiller-host-port")]


def sized(headers: list[tuple[str, str]], body: bytes) -> list[tuple[str, str]]:
    """Headers for a rewritten body: the client's length no longer applies."""
    out = [(n, v) for n, v in headers if n not in ("content-length", "x-prefiller-host-port")]
    out.append(("content-length", str(len(body))))
    return out
