"""The sidecar's own answers, in the style picked once at start: vLLM's, or llm-d's.

``VLLM`` answers every failure in vLLM's OpenAI error shape (``send_error``):
``{"error": {"message", "type", "param", "code"}}`` with ``code`` equal to the
status, as vLLM 0.10.1+ answers. The sidecar's exception tree is drawn once,
in ``sidecar.exceptions``.

``LLMD`` keeps the bodies llm-d's routing sidecar gives, so nothing a client
behind llm-d parses changes: D refusing connections is llm-d's 503 body
(vLLM's older flat error shape), a prefiller outside the allowlist a
plain-text 403 (Go's ``http.Error``: ``text/plain; charset=utf-8`` and
``X-Content-Type-Options: nosniff``), a 503 the sidecar gives itself llm-d's
flat error body, and a prefill leg runs on the one P the request names, whose
failure reaches the client as it is. llm-d writes its 503 body with no
``Content-Type`` (``WriteHeader`` then ``Write`` in its reverse proxy's error
handler), so Go's ``net/http`` sniffs it: JSON is not among the types it
detects, and the answer goes out as ``text/plain; charset=utf-8``, without
``nosniff``. Beyond the answers, ``LLMD`` serves what llm-d's sidecar serves:
``GET /health`` answered 200 on the serving port (D or not), rank 0's table of
data-parallel listeners with a single rank too, and ``x-prefiller-host-port``
taking the router's path with no prefill allowlist configured (every
prefiller refused then, unless the pool's pods are the list).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import msgspec

from sidecar.asgi import Send
from sidecar.classify import NoAnswer
from sidecar.wire import error_body

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


# --- llm-d's bodies ----------------------------------------------------------------------------


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


# --- the style ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class AnswerStyle:
    """One style of the sidecar's own answers (see the module docstring)."""

    name: str
    decode_not_ready: bytes | None = None  # the plain body D refusing connections is answered with
    forbidden: bytes | None = None  # the plain body a prefiller outside the allowlist gets (403)
    one_prefill: bool = False  # one P per prefill leg, its failure passed on as it is
    flat_unavailable: bool = False  # the sidecar's own 503 in llm-d's flat shape, sent as plain text
    serves_health: bool = False  # the serving port answers GET (and HEAD) /health 200 itself
    keeps_rank_table: bool = False  # rank 0 reads x-data-parallel-host-port with a single rank too
    routes_unlisted: bool = False  # router mode with no prefill list: the header names P (checked)

    async def decode_failed(
        self,
        send: Send,
        failure: NoAnswer,
        status: int,
        message: str,
        request_id: str,
        extra: Sequence[Header] = (),
    ) -> None:
        """D gave no answer (``failure``): the client's ``status`` with ``message``."""
        if self.decode_not_ready is not None and failure is NoAnswer.CONNECT_REFUSED:
            await send_plain(send, status, self.decode_not_ready, request_id, extra, sniffed=True)
            return
        await send_error(send, status, message, request_id, extra=extra)

    async def unavailable(self, send: Send, message: str, request_id: str) -> None:
        """503 with ``message``: the sidecar cannot serve the request yet."""
        if self.flat_unavailable:  # as Go sends an untyped body: sniffed as text
            await send_plain(send, 503, flat_error(message), request_id, sniffed=True)
            return
        await send_error(send, 503, message, request_id)

    async def prefill_refused(
        self, send: Send, status: int, message: str, request_id: str, param: str | None
    ) -> None:
        """The prefill leg cannot run (a bad or unlisted ``x-prefiller-host-port``)."""
        if status == 403 and self.forbidden is not None:
            await send_plain(send, 403, self.forbidden, request_id)
            return
        await send_error(send, status, message, request_id, param)


VLLM = AnswerStyle("vllm")
LLMD = AnswerStyle(
    "llm-d",
    decode_not_ready=DECODE_NOT_READY,
    forbidden=FORBIDDEN,
    one_prefill=True,
    flat_unavailable=True,
    serves_health=True,
    keeps_rank_table=True,
    routes_unlisted=True,
)
STYLES = {style.name: style for style in (VLLM, LLMD)}
