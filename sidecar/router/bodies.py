"""Router mode's bodies: the prefill leg's, the decode leg's, and D's answer corrected on the way out.

The prefill leg is llm-d's pd-sidecar's (and vLLM's reference P/D proxy's):
the same body with ``stream: false``, ``stream_options`` removed, every
output-budget field of the route capped to one token (``CAPS``) and
``kv_transfer_params`` asking P to keep the blocks for a remote decode. The
decode leg is the original body, every field as the client sent it, plus the
``kv_transfer_params`` P returned. ``UsageRewriter`` reports P's cached
tokens in D's answer (D got the whole prompt from P).
"""

from __future__ import annotations

from dataclasses import dataclass
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


@dataclass(frozen=True, slots=True)
class Caps:
    """The output-budget fields one route's prefill leg caps to 1.

    ``always`` is set whether the client sent it or not (P computes one token,
    whatever the client asked); ``present`` is capped only when the client
    sent it (a lower bound such as ``min_tokens`` over the cap would make P
    refuse the request). ``nested`` names the object they live in
    (``sampling_params`` on ``/inference/v1/generate``), created if absent.
    """

    always: tuple[str, ...]
    present: tuple[str, ...] = ()
    nested: str | None = None


_CHAT = Caps(always=("max_tokens",), present=("max_completion_tokens", "min_tokens"))

#: Per route, as llm-d-router's pd-sidecar caps them (main, ``pkg/sidecar/proxy/proxy.go``
#: ``tokenLimitFieldsForAPIType``; ``min_tokens`` since after v0.9.0): the chat fields on chat,
#: completions and messages, ``max_output_tokens`` on responses, and ``max_tokens`` and
#: ``min_tokens`` inside ``sampling_params`` on vLLM's token-in generate route.
CAPS: dict[str, Caps] = {
    "/v1/chat/completions": _CHAT,
    "/v1/completions": _CHAT,
    "/v1/messages": _CHAT,
    "/v1/responses": Caps(always=("max_output_tokens",)),
    "/inference/v1/generate": Caps(always=("max_tokens",), present=("min_tokens",), nested="sampling_params"),
}


def prefill_body(request: dict[str, Any], route: str) -> bytes:
    """The prefill leg's body: same prompt, no stream, an output budget of one token."""
    body = dict(request)
    body["stream"] = False
    body.pop("stream_options", None)
    caps = CAPS.get(route, _CHAT)
    target = _capped_object(body, caps.nested)
    if target is not None:
        for name in caps.always:
            target[name] = 1
        for name in caps.present:
            if name in target:
                target[name] = 1
    body["kv_transfer_params"] = dict(PREFILL_PARAMS)
    return _ENCODER.encode(body)


def _capped_object(body: dict[str, Any], nested: str | None) -> dict[str, Any] | None:
    """Where the caps go: the body, or a copy of its ``nested`` object put in its place (created
    when absent); None when that member is not an object (P refuses it as D would)."""
    if nested is None:
        return body
    inner = body.get(nested)
    if inner is not None and not isinstance(inner, dict):
        return None
    copied = dict(inner or {})
    body[nested] = copied
    return copied


def decode_body(request: dict[str, Any], params: dict[str, Any] | None) -> bytes:
    """The decode leg's body: the original request plus P's kv_transfer_params."""
    body = dict(request)
    if params is None:
        body.pop("kv_transfer_params", None)
    else:
        body["kv_transfer_params"] = params
    return _ENCODER.encode(body)


def with_params(request: dict[str, Any], raw: bytes) -> bytes:
    """``decode_body(request, params)`` from the parameters' JSON ``raw``, the same bytes: the
    router encodes P's parameters once (they are also checked and signed) and they go last."""
    if "kv_transfer_params" in request:  # not on the router's path, which drops the client's
        return decode_body(request, _DECODER.decode(raw))
    head = _ENCODER.encode(request)
    member = b'"kv_transfer_params":' + raw + b"}"
    return head[:-1] + (b"," + member if len(head) > 2 else member)


def prefill_headers(headers: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """Client headers for P: the same, minus the length (the body changes) and the routing header."""
    return [(n, v) for n, v in headers if n not in ("content-length", "x-prefiller-host-port")]


def sized(headers: list[tuple[str, str]], body: bytes) -> list[tuple[str, str]]:
    """Headers for a rewritten body: the client's length no longer applies."""
    out = [(n, v) for n, v in headers if n not in ("content-length", "x-prefiller-host-port")]
    out.append(("content-length", str(len(body))))
    return out
