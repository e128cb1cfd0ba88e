"""One request on a client connection and its response: the ASGI ``receive`` and ``send``.

``Cycle`` is what the application sees of one request of the sidecar's HTTP/1.1
server (``sidecar.server.protocol``): its body, handed over as the parser
delivers it, and its response, framed here: a status line and headers checked
as an ASGI server must (names and values, ``content-length`` kept to the
bytes sent), a body by its length or in chunks, ``Connection: close`` when the
connection ends after it. The head is held back until the body's first part
so that both leave in one write; if no part follows in the same loop
iteration (a stream whose first event is still on its way) it leaves alone at
the end of it. Two ways past the two response messages serve the proxy
(``sidecar.transport.relay``): ``answer`` writes a whole answer D sent in one
write, and a relay writes a streamed body's parts straight to the transport
once the head is out (``relayable``).
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Iterable
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, Protocol
from urllib.parse import unquote

from sidecar.asgi import Message, Scope
from sidecar.server.limits import ASGIApp, raw_error

log = logging.getLogger("sidecar.serve")
# The access log keeps the logger name and line uvicorn's servers use (``sidecar.observability.logs``).
access_log = logging.getLogger("uvicorn.access")

HIGH_WATER = 64 * 1024  # request body bytes held for the application before reading pauses
JOIN_LIMIT = 64 * 1024  # a body part up to this size is copied behind the held head: one write
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
# What RFC 9110 allows in a field name (a token) and value; the same checks as uvicorn's.
BAD_NAME = re.compile(b'[\x00-\x1f\x7f()<>@,;:\\[\\]={} \t\\\\"]')
BAD_VALUE = re.compile(b"[\x00-\x08\x0a-\x1f\x7f]")


def _status_line(status: int) -> bytes:
    try:
        phrase = HTTPStatus(status).phrase
    except ValueError:
        phrase = ""
    return f"HTTP/1.1 {status} {phrase}\r\n".encode("ascii")


STATUS_LINE = {status: _status_line(status) for status in range(100, 600)}


class Connection(Protocol):
    """What a cycle needs of its connection (``sidecar.server.protocol.GuardedProtocol``)."""

    transport: asyncio.Transport
    loop: asyncio.AbstractEventLoop
    write_paused: bool
    logs_access: bool

    async def drain(self) -> None: ...

    def body_taken(self) -> None: ...

    def response_done(self, cycle: Cycle) -> None: ...


class Cycle:
    """One request and its response (see the module docstring)."""

    __slots__ = (
        "_conn", "_end_given", "_held", "_remaining", "_waiter", "body", "chunked", "disconnected",
        "head_only", "keep_alive", "more_body", "response_complete", "response_started", "scope",
        "status", "transport", "waiting_for_100_continue",
    )  # fmt: skip

    def __init__(self, conn: Connection, scope: Scope, keep_alive: bool, expect_continue: bool) -> None:
        self._conn = conn
        self.scope = scope
        self.transport = conn.transport
        self.keep_alive = keep_alive
        self.waiting_for_100_continue = expect_continue
        self.head_only = scope["method"] == "HEAD"
        self.body = bytearray()
        self.more_body = True
        self._end_given = False  # the body's last message was handed to the application
        self._waiter: asyncio.Future[None] | None = None
        self.disconnected = False  # the client left, or a limit ended the request
        self.response_started = False
        self.response_complete = False
        self.chunked = False
        self._remaining = 0  # body bytes a content-length still expects
        self._held: bytes | None = None  # the head, until the body's first part
        self.status = 0

    # -- from the connection ---------------------------------------------------------------

    def wake(self) -> None:
        """Body arrived, the body ended, or the client left: a waiting ``receive`` returns."""
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def lost(self) -> None:
        """The client left (or a limit ended the request): ``receive`` says so, sends are dropped."""
        if not self.response_complete:
            self.disconnected = True
        self.wake()

    async def run(self, app: ASGIApp) -> None:
        """The application on this request; what it leaves unanswered is answered or cut here."""
        try:
            result = await app(self.scope, self.receive, self.send)  # type: ignore[func-returns-value]
        except BaseException:  # as any ASGI server: the application's failure ends only its request
            log.exception("exception in the application")
            if not self.response_started:
                self._whole(500, raw_error(500, "InternalServerError", "internal server error"), False)
            else:
                self.transport.close()
            return
        if result is not None:
            log.error("the application returned a value: an ASGI application returns None")
            self.transport.close()
        elif not self.response_started and not self.disconnected:
            log.error("the application returned without starting a response")
            self._whole(500, raw_error(500, "InternalServerError", "internal server error"), False)
        elif not self.response_complete and not self.disconnected:
            log.error("the application returned without completing its response")
            self.transport.close()

    # -- ASGI ------------------------------------------------------------------------------

    async def receive(self) -> Message:
        if self.waiting_for_100_continue and not self.transport.is_closing():
            self.transport.write(CONTINUE)
            self.waiting_for_100_continue = False
        while not (self.disconnected or self.response_complete):
            if self.body or not (self.more_body or self._end_given):
                body, self.body = bytes(self.body), bytearray()
                self._end_given = not self.more_body
                self._conn.body_taken()
                return {"type": "http.request", "body": body, "more_body": self.more_body}
            self._conn.body_taken()  # the application waits: let the client send
            self._waiter = self._conn.loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return {"type": "http.disconnect"}

    async def send(self, message: Message) -> None:
        conn = self._conn
        if conn.write_paused and not self.disconnected:
            await conn.drain()
        if self.disconnected:
            return
        kind = message["type"]
        if not self.response_started:
            if kind != "http.response.start":
                raise RuntimeError(f"expected ASGI message 'http.response.start', got {kind!r}")
            self._start(message["status"], message.get("headers", ()))
        elif not self.response_complete:
            if kind != "http.response.body":
                raise RuntimeError(f"expected ASGI message 'http.response.body', got {kind!r}")
            self._body(message.get("body", b""), message.get("more_body", False))
        else:
            raise RuntimeError(f"ASGI message {kind!r} after the response completed")

    def _start(self, status: int, headers: Iterable[tuple[bytes, bytes]]) -> None:
        self.response_started, self.waiting_for_100_continue, self.status = True, False, status
        if self._conn.logs_access:
            self._log_access()
        content = [STATUS_LINE.get(status) or _status_line(status)]
        framed = closes = False
        for name, value in headers:
            if BAD_NAME.search(name):
                raise RuntimeError(f"invalid HTTP header name {name!r}")
            if BAD_VALUE.search(value):
                raise RuntimeError(f"invalid HTTP header value for {name!r}")
            name = name.lower()
            if name == b"content-length" and not framed:
                self._remaining, framed = int(value), True
            elif name == b"transfer-encoding" and value.lower() == b"chunked" and not framed:
                self.chunked = framed = True
            elif name == b"connection" and b"close" in [t.strip() for t in value.lower().split(b",")]:
                self.keep_alive, closes = False, True
            content += (name, b": ", value, b"\r\n")
        if not self.keep_alive and not closes:
            content.append(b"connection: close\r\n")
        if not framed and not self.head_only and status not in (204, 304):
            self.chunked = True
            content.append(b"transfer-encoding: chunked\r\n")
        content.append(b"\r\n")
        self._held = b"".join(content)
        self._conn.loop.call_soon(self._flush)  # a head no body follows this iteration leaves alone

    def _body(self, body: bytes, more: bool) -> None:
        if self.head_only:
            data, self._remaining = b"", 0
        elif self.chunked:
            data = b"%x\r\n%b\r\n" % (len(body), body) if body else b""
            if not more:
                data += b"0\r\n\r\n"
        else:
            if len(body) > self._remaining:
                raise RuntimeError("response body longer than its content-length")
            self._remaining -= len(body)
            data = body
        held, self._held = self._held, None
        if held is None:
            if data:
                self.transport.write(data)
        elif len(data) <= JOIN_LIMIT:
            self.transport.write(held + data)
        else:  # no copy of a large body
            self.transport.writelines((held, data))
        if not more:
            if self._remaining:
                raise RuntimeError("response body shorter than its content-length")
            self._done()

    def _flush(self) -> None:
        held, self._held = self._held, None
        if held is not None and not self.transport.is_closing():
            self.transport.write(held)

    def _done(self) -> None:
        self.response_complete = True
        self.wake()
        if not self.keep_alive:
            self.transport.close()
        self._conn.response_done(self)

    def _whole(self, status: int, data: bytes, keep_alive: bool) -> None:
        """A complete response in one write, its framing checked by the caller."""
        self.response_started, self.waiting_for_100_continue, self.status = True, False, status
        self.keep_alive = self.keep_alive and keep_alive
        if self._conn.logs_access:
            self._log_access()
        self.transport.write(data)
        self._done()

    def _log_access(self) -> None:
        scope = self.scope
        client = scope.get("client")
        path = scope["raw_path"].decode("latin-1")
        if scope["query_string"]:
            path += "?" + scope["query_string"].decode("ascii")
        access_log.info(
            '%s - "%s %s HTTP/%s" %d',
            f"{client[0]}:{client[1]}" if client else "",
            scope["method"],
            path.replace('"', "%22"),
            scope["http_version"],
            self.status,
        )

    # -- the relay's view (``sidecar.transport.relay.Response``) -----------------------------

    def relayable(self) -> bool:
        """A chunked body has started and not ended, and the client is still there; the head is
        put on the wire, so that what the relay writes follows it."""
        if not (self.chunked and self.response_started) or self.response_complete or self.disconnected:
            return False
        self._flush()
        return True

    def write_paused(self) -> bool:
        return self._conn.write_paused

    def gone(self) -> bool:
        return self.disconnected

    def answer(self, status: int, head: list[tuple[bytes, bytes]], body: bytes) -> bool:
        """The whole response in one write, ended as ``send`` ends one
        (``sidecar.transport.relay.ClientRelay.answer``). Only for a response not yet started, to
        a client still there and not holding writes back, and a ``head`` that names ``body``'s
        exact length; else False, nothing written. The header checks ``send`` makes are not
        repeated: every name and value in ``head`` came through llhttp's parser (D's headers,
        the client's request id)."""
        if self.response_started or self.disconnected or self._conn.write_paused:
            return False
        length = b"%d" % len(body)
        content = [STATUS_LINE.get(status) or _status_line(status)]
        framed = False
        for name, value in head:
            if name == b"content-length":
                if framed or value != length:
                    return False
                framed = True
            elif name == b"transfer-encoding":
                return False
            content += (name, b": ", value, b"\r\n")
        if not framed:
            return False
        if not self.keep_alive:
            content.append(b"connection: close\r\n")
        content.append(b"\r\n")
        if not self.head_only:
            content.append(body)
        self._whole(status, b"".join(content), True)
        return True


@dataclass(frozen=True, slots=True)
class Endpoints:
    """A connection's two ends and its scheme, as a request's scope names them."""

    server: tuple[str, int | None] | None
    client: tuple[str, int] | None
    scheme: str

    @classmethod
    def of(cls, transport: asyncio.BaseTransport) -> Endpoints:
        local, peer = transport.get_extra_info("sockname"), transport.get_extra_info("peername")
        server: tuple[str, int | None] | None = None
        if isinstance(local, tuple):
            server = (str(local[0]), int(local[1]))
        elif isinstance(local, str):  # a Unix socket's path
            server = (local, None)
        client = (str(peer[0]), int(peer[1])) if isinstance(peer, tuple) and len(peer) >= 2 else None
        return cls(server, client, "https" if transport.get_extra_info("sslcontext") else "http")


def request_scope(
    method: str,
    version: str,
    url: Any,
    headers: list[tuple[bytes, bytes]],
    ends: Endpoints,
    state: dict[str, Any],
) -> Scope:
    """The ASGI ``http`` scope of one request (``url``: ``httptools.parse_url``'s answer)."""
    raw_path: bytes = url.path
    path = raw_path.decode("ascii")
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": version,
        "server": ends.server,
        "client": ends.client,
        "scheme": ends.scheme,
        "method": method,
        "root_path": "",
        "path": unquote(path) if "%" in path else path,
        "raw_path": raw_path,
        "query_string": url.query or b"",
        "headers": headers,
        "state": state.copy(),
    }
