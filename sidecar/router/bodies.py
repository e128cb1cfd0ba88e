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


def correct_usage(payload: Any, cached_tokens: int) -> bool:
    """Report P's cached tokens instead of D's (D got the whole prompt from P). True if changed."""
    usage = payload.get("usage") if isinstance(payload, dict) else None
    if not isinstance(usage, dict):
        return False
    changed = False
    for key in ("prompt_tokens_details", "input_tokens_details"):
        details = usage.get(key)
        if isinstance(details, dict) and "cached_tokens" in details:
            details["cached_tokens"] = cached_tokens
            changed = True
    return changed


class UsageRewriter:
    """Corrects ``cached_tokens`` in D's answer as it passes (JSON body or SSE events)."""

    def __init__(self, cached_tokens: int, stream: bool) -> None:
        self.cached_tokens = cached_tokens
        self.stream = stream
        self._pending = b""

    def json(self, body: bytes) -> bytes:
        try:
            payload = _DECODER.decode(body)
        except msgspec.DecodeError:
            return body
        return _ENCODER.encode(payload) if correct_usage(payload, self.cached_tokens) else body

    def feed(self, chunk: bytes) -> bytes:
        """Complete SSE events of ``chunk`` (corrected); a trailing partial event is held back."""
        data = self._pending + chunk
        end = data.rfind(b"\n\n")
        if end < 0:
            self._pending = data
            return b""
        self._pending = data[end + 2 :]
        events = data[: end + 2]
        if b"cached_tokens" not in events:
            return events
        return b"".join(self._event(e) for e in events.split(b"\n\n")[:-1])

    def flush(self) -> bytes:
        rest, self._pending = self._pending, b""
        return rest

    def _event(self, event: bytes) -> bytes:
        if b"cached_tokens" not in event:
            return event + b"\n\n"
        lines = event.split(b"\n")
        for index, line in enumerate(lines):
            if line.startswith(b"data:"):
                try:
                    payload = _DECODER.decode(line[5:].strip())
                except msgspec.DecodeError:
                    continue
                if correct_usage(payload, self.cached_tokens):
                    lines[index] = b"data: " + _ENCODER.encode(payload)
        return b"\n".join(lines) + b"\n\n"


def prefill_headers(headers: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """Client headers for P: the same, minus the length (the body changes) and the routing header."""
    return [(n, v) for n, v in headers if n not in ("content-length", "x-prefiller-host-port")]


def sized(headers: list[tuple[str, str]], body: bytes) -> list[tuple[str, str]]:
    """Headers for a rewritten body: the client's length no longer applies."""
    out = [(n, v) for n, v in headers if n not in ("content-length", "x-prefiller-host-port")]
    out.append(("content-length", str(len(body))))
    return out
