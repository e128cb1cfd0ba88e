"""llm-d's routing sidecar's own answers, given with ``answers = "llm-d"``.

Clients behind llm-d see these bodies today; the drop-in keeps them so that
nothing a client parses changes: ``GET /health`` answered 200 on the serving
port (D or not), a prefiller outside the InferencePool refused with a
plain-text 403 (Go's ``http.Error``: ``text/plain; charset=utf-8`` and
``X-Content-Type-Options: nosniff``), and D refusing connections answered with
llm-d's 503 body (vLLM's older flat error shape). llm-d writes that body with no
``Content-Type`` (``WriteHeader`` then ``Write`` in its reverse proxy's error
handler), so Go's ``net/http`` sniffs it: JSON is not among the types it
detects, and the answer goes out as ``text/plain; charset=utf-8``, without
``nosniff``.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from sidecar.asgi import Send
from sidecar.proxy.answers import Header


def flat_error(message: str) -> bytes:
    """A 503 body in llm-d's flat error shape (vLLM's older one), as ``DECODE_NOT_READY``."""
    return (
        b'{"object":"error","message":'
        + msgspec.json.encode(message)
        + b',"type":"ServiceUnavailable","param":"","code":503}'
    )


FORBIDDEN = b"Forbidden: prefill target not allowed by SSRF protection\n"
DECODE_NOT_READY = (
    b'{"object":"error","message":"The decode node is not ready. Please check that the vLLM service is '
    b'running and the port configuration is correct.","type":"ServiceUnavailable","param":"","code":503}'
)


async def send_plain(
    send: Send,
    status: int,
    body: bytes,
    request_id: str,
    extra: Sequence[Header] = (),
    *,
    sniffed: bool = False,
) -> None:
    """A complete plain-text answer, as Go's ``http.Error`` writes it; ``sniffed``: as Go sends a
    body written with no ``Content-Type`` that it sniffs as text (no ``nosniff``)."""
    headers = [(b"content-type", b"text/plain; charset=utf-8")]
    headers += [] if sniffed else [(b"x-content-type-options", b"nosniff")]
    headers += [(b"content-length", str(len(body)).encode()), (b"x-request-id", request_id.encode("latin-1"))]
    headers += extra
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})
