"""Answers the sidecar gives itself, in vLLM's OpenAI error shape.

The sidecar's exception tree is drawn once, in ``sidecar.exceptions``. Bodies
are ``{"error": {"message", "type", "param", "code"}}`` with ``code`` equal to
the status, as vLLM 0.10.1+ answers.
"""

from __future__ import annotations

from collections.abc import Sequence

from sidecar.asgi import Send
from sidecar.classify import FAILURE_STATUS
from sidecar.wire import error_body

__all__ = ["ERROR_TYPES", "FAILURE_STATUS", "Header", "send_error", "send_raw"]

ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    409: "ConflictError",
    410: "GoneError",
    413: "RequestEntityTooLargeError",
    422: "UnprocessableEntityError",  # vLLM's type for 422 (0.25.0+)
    429: "RateLimitError",
    500: "InternalServerError",
    501: "NotImplementedError",
    502: "BadGatewayError",
    503: "ServiceUnavailableError",
    504: "GatewayTimeoutError",
}

Header = tuple[bytes, bytes]
#: The answer is an injected rejection (load tests).
INJECTED: Header = (b"x-kvr-injected", b"true")
#: Shed the client's connection after this answer.
CLOSE: Header = (b"connection", b"close")
#: The request's kv_transfer_params were released (or refused as spent): a retry with them is
#: refused (409), so a client must not retry it as it is. The OpenAI SDKs honour this header.
NO_RETRY: Header = (b"x-should-retry", b"false")


async def send_error(
    send: Send,
    status: int,
    message: str,
    request_id: str,
    param: str | None = None,
    extra: Sequence[Header] = (),
) -> None:
    """Send a complete vLLM-shaped JSON error response, with ``extra`` headers."""
    fallback = "BadRequestError" if status < 500 else "InternalServerError"
    body = error_body(message, status, ERROR_TYPES.get(status, fallback), param)
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"x-request-id", request_id.encode("latin-1")),
        *extra,
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def send_raw(send: Send, status: int, body: bytes, request_id: str) -> None:
    """Relay another server's complete JSON answer (P's error in router mode)."""
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"x-request-id", request_id.encode("latin-1")),
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})
