"""What a server enforces on its clients (``ServerLimits``), and the raw answer it closes with.

The proxy port's limits come from the config's client settings; the admin
port's have no concurrency limit (probes must answer) and no access log.
``raw_error`` is a complete HTTP/1.1 error in vLLM's shape, written by the
server protocol itself when a limit is hit before any application runs.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from http import HTTPStatus

from sidecar import config as config_mod
from sidecar.asgi import OVER_LIMIT, Receive, Scope, Send
from sidecar.wire import error_body

ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class ServerLimits:
    """The limits a server enforces on its clients (``Config`` fields of the same meaning)."""

    max_header_bytes: int = 64 * 1024
    header_timeout: float = 10.0
    body_timeout: float = 60.0
    concurrency: int = 0  # requests in flight; 0 = unlimited
    keep_alive: float = 5.0
    access_log: bool = False  # one uvicorn.access line per request

    @classmethod
    def of(cls, config: config_mod.Config, admin: bool = False) -> ServerLimits:
        """The proxy port's limits; the admin port has no concurrency limit (probes must answer)."""
        return cls(
            max_header_bytes=config.max_header_bytes,
            header_timeout=config.client_header_timeout,
            body_timeout=config.client_body_timeout,
            concurrency=0 if admin else config.limit_concurrency,
            keep_alive=config.timeout_keep_alive,
            access_log=config.access_log and not admin,  # probes every second are no one's news
        )


def raw_error(status: int, type_: str, message: str) -> bytes:
    """A complete HTTP/1.1 error response in vLLM's shape that closes the connection."""
    body = error_body(message, status, type_)
    head = (
        f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\n"
        "content-type: application/json\r\n"
        f"content-length: {len(body)}\r\n"
        "connection: close\r\n\r\n"
    )
    return head.encode("ascii") + body


def marked_over_limit(app: ASGIApp) -> ASGIApp:
    """``app``, seeing the request marked as over the limit: it answers 503 itself (``Proxy``
    reads the body first, so P's blocks named in it are released)."""

    async def marked(scope: Scope, receive: Receive, send: Send) -> None:
        extensions = {**(scope.get("extensions") or {}), OVER_LIMIT: {}}
        await app({**scope, "extensions": extensions}, receive, send)

    return marked
