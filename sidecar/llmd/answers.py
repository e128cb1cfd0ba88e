"""llm-d's routing sidecar's own answers, given with ``answers = "llm-d"``.

Clients behind llm-d see these bodies today; the drop-in keeps them so that
nothing a client parses changes: ``GET /health`` answered 200 on the serving
port (D or not), a prefiller outside the InferencePool refused with a
plain-text 403, and D refusing connections answered with llm-d's 503 body
(vLLM's older flat error shape).
"""

from __future__ import annotations

from sidecar.asgi import Send

FORBIDDEN = b"Forbidden: prefill target not allowed by SSRF protection\n"
DECODE_NOT_READY = (
    b'{"object":"error","message":"The decode node is not ready. Please check that the vLLM service is '
    b'running and the port configuration is correct.","type":"ServiceUnavailable","param":"","code":503}'
)


async def send_plain(send: Send, status: int, body: bytes, request_id: str) -> None:
    """A complete plain-text answer, as Go's ``http.Error`` writes it."""
    headers = [
        (b"content-type", b"text/plain; charset=utf-8"),
        (b"x-content-type-options", b"nosniff"),
        (b"content-length", str(len(body)).encode()),
        (b"x-request-id", request_id.encode("latin-1")),
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})
