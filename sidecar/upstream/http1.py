"""One HTTP/1.1 client connection: an asyncio Protocol around llhttp (``httptools``).

llhttp does all response parsing (status line, headers, chunked framing,
keep-alive); this module adds what a proxy needs around it: a response body
kept as the raw bytes D sent (no content decoding), reading paused while more
than ``HIGH_WATER`` bytes wait for the consumer, request bodies streamed with
write flow control, and an exact record of whether the connection can carry
another request. Errors surface as ``OSError`` (D closed or reset the connection),
``ProtocolError`` (D sent something that is not HTTP/1.1), ``BodyError`` (the
caller's request body failed) and ``TimeoutError``; ``sidecar.upstream``
turns them into failures.

One exchange runs at a time (no pipelining). The parser is kept for the
next exchange only after a response llhttp parsed to its end, so a HEAD
response (llhttp cannot be told it has no body) or a protocol error never
leaks into the next one. The waits for D share the connection's one timer.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import cast

import httptools

from sidecar.exceptions import SidecarError
from sidecar.timers import WaitTimer
from sidecar.upstream.framing import body_ends_at_eof

HIGH_WATER = 256 * 1024  # response bytes buffered for a slow consumer before reading pauses


class ProtocolError(SidecarError):
    """D answered with something that is not a valid HTTP/1.1 response."""


class BodyError(SidecarError):
    """The request body's iterator failed, or did not match its declared length."""


def _wake(waiter: asyncio.Future[None] | None) -> None:
    if waiter is not None and not waiter.done():
        waiter.set_result(None)


class Connection(asyncio.Protocol):
    """A keep-alive connection to D; ``sidecar.upstream`` pools them."""

    __slots__ = (
        "_body",
        "_body_waiter",
        "_close",
        "_completed_at",
        "_drain_waiter",
        "_error",
        "_extra",
        "_head_only",
        "_head_waiter",
        "_interim",
        "_loop",
        "_on_lost",
        "_open",
        "_parser",
        "_read_paused",
        "_request_done",
        "_spare",
        "_timer",
        "_write_paused",
        "_writer",
        "buffered",
        "complete",
        "headers",
        "idle_since",
        "keep_alive",
        "status",
        "transport",
    )

    def __init__(self, loop: asyncio.AbstractEventLoop, on_lost: Callable[[Connection], None]) -> None:
        self._loop = loop
        self._on_lost = on_lost
        self.transport: asyncio.Transport | None = None
        self.idle_since = 0.0
        self._open = True  # False once D closed, reset, or the connection was aborted
        self._write_paused = False
        self._drain_waiter: asyncio.Future[None] | None = None
        self._writer: asyncio.Task[None] | None = None
        # The current exchange (reset by ``begin``).
        self._parser: httptools.HttpResponseParser | None = None  # None: idle, D must stay silent
        self._spare: httptools.HttpResponseParser | None = None  # the parser, between two exchanges
        self._timer = WaitTimer(loop)  # the one timer of the waits for D
        self._head_only = False
        self._close = False
        self._request_done = True
        self._head_waiter: asyncio.Future[None] | None = None
        self._body_waiter: asyncio.Future[None] | None = None
        self._error: BaseException | None = None  # why the exchange broke before it completed
        self._interim = False
        self._extra = False  # D sent bytes beyond the response: never reuse
        self._read_paused = False
        self._body: list[bytes] = []
        self.buffered = 0
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.keep_alive = False
        self.complete = False
        self._completed_at = 0.0  # loop time D's response ended: D's keep-alive clock starts then

    # -- the pool's view --------------------------------------------------

    @property
    def usable(self) -> bool:
        """Open and quiet: D has not closed it (EOF) and it is not closing."""
        return self._open and self.transport is not None and not self.transport.is_closing()

    @property
    def reusable(self) -> bool:
        """The exchange ended cleanly on both sides and both agree to keep the connection."""
        return (
            self.complete
            and self.keep_alive
            and self._request_done
            and not self._close
            and not self._extra
            and self.usable
        )

    def idle(self, now: float) -> None:
        """Park a reusable connection: D speaking now is a protocol error."""
        # llhttp is ready for the next response, unless it still expects a HEAD response's body.
        self._spare = None if self._head_only else self._parser
        self._parser = None
        self._head_waiter = None
        self._body = []
        self.buffered = 0
        # Idle since D finished its answer, not since the client read the last of it (a slow
        # client can take seconds): D's keep-alive timer has been running from its last write.
        self.idle_since = self._completed_at or now
        if self._read_paused:
            self._read_paused = False
            assert self.transport is not None
            self.transport.resume_reading()

    def abort(self) -> None:
        """Drop the connection now (D sees the abort); a body still being written stops."""
        self._open = False
        writer = self._writer
        if writer is not None and not writer.done() and writer is not asyncio.current_task():
            writer.cancel()
        if self.transport is not None:
            if self.complete and self._request_done:
                self.transport.close()
            else:
                self.transport.abort()

    # -- one exchange -------------------------------------------------------

    def begin(self, head: bytes, body: bytes, *, head_only: bool, close: bool) -> None:
        """Start an exchange and write the request (one write when the body is small)."""
        self._reset(head_only, close)
        assert self.transport is not None
        if len(body) <= HIGH_WATER:
            self.transport.write(head + body if body else head)
        else:  # no extra copy of a large body
            self.transport.write(head)
            self.transport.write(body)

    def begin_stream(
        self, head: bytes, body: AsyncIterator[bytes], length: int | None, *, head_only: bool, close: bool
    ) -> None:
        """Start an exchange whose body is written by a task (chunked when ``length`` is None)."""
        self._reset(head_only, close)
        assert self.transport is not None
        self.transport.write(head)
        self._request_done = False
        self._writer = self._loop.create_task(self._write_body(body, length))

    def _reset(self, head_only: bool, close: bool) -> None:
        parser, self._spare = self._spare, None
        self._parser = httptools.HttpResponseParser(self) if parser is None else parser
        self._head_only = head_only
        self._close = close
        self._request_done = True
        self._head_waiter = self._loop.create_future()
        self._error = None
        self._interim = False
        self._body = []
        self.buffered = 0
        self.status = 0
        self.headers = []
        self.keep_alive = False
        self.complete = False
        self._completed_at = 0.0

    async def wait_head(self, within: float) -> None:
        """Until D's final response headers arrived (``TimeoutError`` after ``within`` seconds)."""
        waiter = self._head_waiter
        assert waiter is not None
        if not waiter.done():
            await self._timer.wait(waiter, within)
        if not self.status:
            raise self._error or ConnectionResetError("D closed the connection")

    def take(self) -> bytes:
        """All body bytes received and not yet taken (b"" if none)."""
        body = self._body
        if not body:
            return b""
        chunk = body[0] if len(body) == 1 else b"".join(body)
        self._body = []
        self.buffered = 0
        if self._read_paused:
            self._read_paused = False
            assert self.transport is not None
            self.transport.resume_reading()
        return chunk

    async def wait_body(self, within: float | None) -> None:
        """Until more body bytes arrive or the body ends; raises if it broke or ``within`` passed."""
        if self._body or self.complete:
            return
        if self._error is not None:
            raise self._error
        waiter = self._body_waiter = self._loop.create_future()
        try:
            if within:
                await self._timer.wait(waiter, within)
            else:
                await waiter
        finally:
            self._body_waiter = None
        if not self._body and not self.complete and self._error is not None:
            raise self._error

    # -- request body ---------------------------------------------------------

    async def _write_body(self, body: AsyncIterator[bytes], length: int | None) -> None:
        try:
            await self._send_body(body, length)
        except (OSError, BodyError) as exc:
            self._fail(exc)
        except Exception as exc:  # the caller's iterator broke: D gets a truncated request
            error = BodyError(f"request body: {exc!r}")
            error.__cause__ = exc
            self._fail(error)
        else:
            self._request_done = True

    async def _send_body(self, body: AsyncIterator[bytes], length: int | None) -> None:
        transport = self.transport
        assert transport is not None
        sent = 0
        async for chunk in body:
            if not chunk:
                continue
            if not self._open:
                raise ConnectionResetError("D closed the connection during the request body")
            sent += len(chunk)
            if length is None:
                transport.writelines((b"%x\r\n" % len(chunk), chunk, b"\r\n"))
            elif sent > length:
                raise BodyError(f"request body longer than its content-length {length}")
            else:
                transport.write(chunk)
            if self._write_paused:
                await self._drain()
        if length is None:
            transport.write(b"0\r\n\r\n")
        elif sent != length:
            raise BodyError(f"request body of {sent} bytes, content-length {length}")

    async def _drain(self) -> None:
        while self._write_paused and self._open:
            waiter = self._drain_waiter = self._loop.create_future()
            try:
                await waiter
            finally:
                self._drain_waiter = None
        if not self._open:
            raise ConnectionResetError("D closed the connection during the request body")

    def _fail(self, exc: BaseException) -> None:
        if self._parser is not None and not self.complete and self._error is None:
            self._error = exc
        self.abort()
        _wake(self._head_waiter)
        _wake(self._body_waiter)

    # -- asyncio.Protocol -------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        parser = self._parser
        if parser is None:
            self._fail(ProtocolError("D sent data on an idle connection"))
            return
        try:
            parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(ProtocolError("D switched protocols"))
        except httptools.HttpParserError as exc:
            self._fail(ProtocolError(f"malformed response from D: {exc}"))

    def eof_received(self) -> bool:
        self._end(None)
        return False  # close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        self._timer.stop()
        self._end(exc)
        _wake(self._drain_waiter)
        self._on_lost(self)

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        _wake(self._drain_waiter)

    def _end(self, exc: BaseException | None) -> None:
        """D closed (or reset) the connection: complete an EOF-delimited body, or break the exchange."""
        self._open = False
        if self._parser is not None and not self.complete and self._error is None:
            if self.status and body_ends_at_eof(self.headers):
                self.complete = True
            elif self.status:
                self._error = exc or ConnectionResetError("D closed the connection mid-body")
            else:
                self._error = exc or ConnectionResetError("D closed the connection before its headers")
        _wake(self._head_waiter)
        _wake(self._body_waiter)

    # -- httptools callbacks -------------------------------------------------------

    def on_message_begin(self) -> None:
        if self.complete:  # a second response to one request
            self._extra = True

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        parser = self._parser
        assert parser is not None
        status = parser.get_status_code()
        if status < 200:  # 1xx interim (100 Continue, 103 Early Hints): the final response follows
            self._interim = True
            self.headers = []
            return
        if self.complete or self.status:
            self._extra = True
            return
        self.status = status
        self.keep_alive = parser.should_keep_alive()
        if self._head_only:  # llhttp cannot be told; the parser is dropped after this exchange
            self.complete = True
        _wake(self._head_waiter)

    def on_body(self, body: bytes) -> None:
        if self.complete:  # a body on a HEAD response
            self._extra = True
            return
        self._body.append(body)
        self.buffered += len(body)
        if self.buffered > HIGH_WATER and not self._read_paused:
            self._read_paused = True
            assert self.transport is not None
            self.transport.pause_reading()
        _wake(self._body_waiter)

    def on_message_complete(self) -> None:
        if self._interim:
            self._interim = False
            return
        self.complete = True
        self._completed_at = self._loop.time()
        _wake(self._body_waiter)
