"""Router mode's correction of D's answer: ``cached_tokens`` reported from P, as it passes.

D got the whole prompt from P's KV cache, so its ``cached_tokens`` says nothing of
the prefix P found cached; the router reports P's figure instead, in a JSON
body or in the SSE events of a stream.
"""

from __future__ import annotations

from typing import Any

import msgspec

_DECODER = msgspec.json.Decoder()
_ENCODER = msgspec.json.Encoder()


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
        if not self._pending and chunk.endswith(b"\n\n") and b"cached_tokens" not in chunk:
            return chunk  # whole events with nothing to correct: nearly every part of a stream
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
