"""The only module that knows how the sidecar talks HTTP to D; the interface below is the seam.

The sidecar first used aiohttp, the fastest general client measured here
(0.24-0.45 ms of CPU per request against 0.7-4.5 ms for httpx). With the
sidecar pinned to one core, ``make bench`` still showed it at 0.35x direct
requests per second at 32 connections, with 0.36 s of proxy CPU per 1,000
JSON requests, and a profile put 45% of that CPU in aiohttp's request
machinery (URL parsing, header multidicts, payload type lookup, connection
acquire and release, the writer). So the client is now our own small
HTTP/1.1 keep-alive pool (``sidecar.upstream.http1``: asyncio Protocols, responses
parsed by llhttp through ``httptools``): on uvloop it costs about 32 us of CPU
per request at 32 connections where aiohttp cost about 80 us, and the
benchmark's proxy CPU per 1,000 JSON requests fell from 0.21-0.25 s to
0.12-0.19 s. It sits behind the same narrow interface, which is the seam:
``Upstream.send`` returns an ``UpstreamResponse`` whose body is an async
iterator of the raw bytes D sent (de-chunked, never decompressed, buffered
only up to a bound). Transport errors are translated here, once, into
``UpstreamError`` carrying a ``classify.NoAnswer``: whether the request may
have reached D is decided at this boundary and nowhere else.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
from collections.abc import AsyncIterator
from types import TracebackType
from typing import Protocol
from urllib.parse import urlsplit

from sidecar.classify import NoAnswer
from sidecar.exceptions import SidecarError
from sidecar.transport.relay import ClientRelay, Feed
from sidecar.upstream.framing import encode_head
from sidecar.upstream.http1 import BodyError, Connection, ProtocolError

Headers = list[tuple[bytes, bytes]]
# An idle connection older than this is closed rather than reused. vLLM serves with uvicorn's
# keep-alive of 5 s (VLLM_HTTP_TIMEOUT_KEEP_ALIVE, 0.9 to 0.34): dropping ours first keeps a
# request from being written on a connection D is closing, which would end in RESET_AFTER_SEND.
KEEPALIVE_SECONDS = 4.0


class Sent:
    """Whether a request may have reached D.

    ``may_have_reached_d`` turns True just before the request's first byte is
    written on a connection. A failure or a cancellation before that (waiting
    for a pool slot, resolving, connecting) is a definite "not forwarded".
    """

    __slots__ = ("may_have_reached_d",)

    def __init__(self) -> None:
        self.may_have_reached_d = False


class UpstreamError(SidecarError):
    """A request to D that produced no response headers, or a body D broke off."""

    def __init__(self, failure: NoAnswer, detail: str) -> None:
        super().__init__(detail)
        self.failure = failure


class Response(Protocol):
    """D's status and headers; the body is read with ``chunks()`` or ``read()``."""

    status: int
    headers: Headers

    def chunks(self) -> AsyncIterator[bytes]: ...

    @property
    def ended(self) -> bool:
        """The body has ended and ``chunks()`` gave all of it: its next chunk would be its end."""
        ...

    async def read(self, limit: int) -> bytes: ...

    def whole(self) -> bytes | None:
        """All of the body when it has all arrived, else None; only before it is read otherwise."""
        ...

    async def relay(self, relay: ClientRelay, feed: Feed | None = None) -> bool: ...

    async def __aenter__(self) -> Response: ...

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None: ...


class Client(Protocol):
    """The seam between the request path and D (or P, in router mode): ``Upstream`` in
    production, a fake in unit tests (``tests.support.fakes.FakeUpstream``)."""

    base_url: str

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    async def send(
        self,
        method: str,
        target: str,
        headers: list[tuple[str, str]],
        body: bytes | AsyncIterator[bytes] | None,
        header_timeout: float | None = None,
        sent: Sent | None = None,
    ) -> Response: ...


class UpstreamResponse:
    """D's status and headers; the body is read with ``chunks()``."""

    __slots__ = ("_conn", "_read_timeout", "_upstream", "headers", "status")

    def __init__(self, conn: Connection, upstream: Upstream, read_timeout: float | None) -> None:
        self._conn = conn
        self._upstream: Upstream | None = upstream
        self._read_timeout = read_timeout
        self.status: int = conn.status
        self.headers: Headers = conn.headers

    async def chunks(self) -> AsyncIterator[bytes]:
        """Body bytes as D sends them. Raises ``UpstreamError`` on a reset or stall."""
        while chunk := await self._next():
            yield chunk

    @property
    def ended(self) -> bool:
        """The body has ended and ``chunks()`` gave all of it: its next chunk would be its end."""
        conn = self._conn
        return self._upstream is not None and conn.complete and not conn.buffered

    def whole(self) -> bytes | None:
        """All of the body when it has all arrived, else None (then nothing is taken: ``chunks()``
        gives it all as before). Only before the body is read any other way."""
        conn = self._conn
        if self._upstream is None or not conn.complete:
            return None
        return conn.take()

    async def read(self, limit: int) -> bytes:
        """Read at most about ``limit`` bytes of the body (for small error bodies)."""
        parts: list[bytes] = []
        size = 0
        while size < limit and (chunk := await self._next()):
            parts.append(chunk)
            size += len(chunk)
        return b"".join(parts)

    async def relay(self, relay: ClientRelay, feed: Feed | None = None) -> bool:
        """The rest of the body straight from D's connection to the client (``sidecar.transport.relay``),
        until it ends; False, having relayed nothing, when the client's response cannot take it.
        Raises ``UpstreamError`` as ``chunks()`` does."""
        conn = self._conn
        if self._upstream is None or conn.complete or not relay.open(conn, feed):
            return False
        try:
            rest = conn.take()
            if rest:
                relay.write(rest)
            conn.relay_to(relay)
            while not conn.complete:
                await self._relayed(conn)
        finally:
            conn.relay_to(None)
            relay.close()
        return True

    async def _relayed(self, conn: Connection) -> None:
        """Until the body ends or breaks; a read timeout counts D's silence, not the client's."""
        timeout, now = self._read_timeout, asyncio.get_running_loop().time()
        try:
            await conn.wait_body(None if timeout is None else max(0.001, conn.last_body + timeout - now))
        except TimeoutError as exc:
            assert timeout is not None
            if not conn.relay_paused and conn.last_body + timeout <= asyncio.get_running_loop().time():
                raise UpstreamError(NoAnswer.HEADER_TIMEOUT, "D stalled mid-body") from exc
        except (OSError, ProtocolError, BodyError) as exc:
            raise UpstreamError(NoAnswer.RESET_AFTER_SEND, f"D reset mid-body: {exc!r}") from exc

    async def _next(self) -> bytes:
        conn = self._conn
        while self._upstream is not None:
            chunk = conn.take()
            if chunk or conn.complete:
                return chunk
            try:
                await conn.wait_body(self._read_timeout)
            except TimeoutError as exc:
                raise UpstreamError(NoAnswer.HEADER_TIMEOUT, "D stalled mid-body") from exc
            except (OSError, ProtocolError, BodyError) as exc:
                raise UpstreamError(NoAnswer.RESET_AFTER_SEND, f"D reset mid-body: {exc!r}") from exc
        return b""

    def close(self) -> None:
        """Pool the connection if the response was complete, else drop it (D sees an abort)."""
        upstream, self._upstream = self._upstream, None
        if upstream is not None:
            upstream._release(self._conn)

    async def __aenter__(self) -> UpstreamResponse:
        return self

    async def __aexit__(
        self, typ: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class Upstream:
    """A pooled client for one decode server, built once in the lifespan.

    At most ``pool_size`` requests are in flight (a semaphore, waited on for
    up to ``pool_timeout``), so there are never more connections than that.
    Idle connections are reused newest first; one D closed while idle is
    noticed (EOF) and never handed out. A request is never retried: once its
    first byte is written D may have it, so a reset then is RESET_AFTER_SEND.
    """

    def __init__(
        self,
        base_url: str,
        *,
        connect_timeout: float,
        pool_timeout: float,
        header_timeout: float,
        read_timeout: float,
        pool_size: int,
    ) -> None:
        url = urlsplit(base_url)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(f"decode URL {base_url!r}: must be an http(s) URL with a host")
        self.base_url = base_url.rstrip("/")
        self._host = url.hostname
        self._port = url.port or (443 if url.scheme == "https" else 80)
        self._authority = url.netloc.rpartition("@")[2]
        self._prefix = url.path.rstrip("/")
        # https: the system's trust store and hostname checks, until ``use_tls`` sets a context.
        self._ssl = ssl.create_default_context() if url.scheme == "https" else None
        self._connect_timeout = connect_timeout
        self._pool_timeout = pool_timeout
        self._header_timeout = header_timeout
        self._read_timeout = read_timeout or None
        self._gate = asyncio.Semaphore(pool_size)
        self._idle: dict[Connection, None] = {}  # insertion order: popitem() gives the newest
        self._conns: set[Connection] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False

    def use_tls(self, context: ssl.SSLContext) -> Upstream:
        """Verify an https server with ``context`` (``sidecar.tls.client``); no effect on http."""
        if self._ssl is not None:
            self._ssl = context
        return self

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()

    async def close(self) -> None:
        """Drop every connection, idle or busy."""
        self._closed = True
        for conn in list(self._conns):
            conn.abort()
        self._idle.clear()
        await asyncio.sleep(0)  # let the transports run connection_lost and close their sockets

    async def send(
        self,
        method: str,
        target: str,
        headers: list[tuple[str, str]],
        body: bytes | AsyncIterator[bytes] | None,
        header_timeout: float | None = None,
        sent: Sent | None = None,
    ) -> UpstreamResponse:
        """Send one request; return once D's response headers arrived.

        ``sent`` (optional) learns whether the request reached the wire.
        ``header_timeout`` (default: the configured one) bounds connecting,
        sending and waiting for the headers together.
        """
        loop = self._loop
        assert loop is not None, "Upstream.start() was not called"
        if self._closed:
            raise UpstreamError(NoAnswer.CONNECT_REFUSED, "the upstream client is closed")
        if self._gate.locked():
            await self._wait_for_slot()
        else:
            await self._gate.acquire()
        timeout = header_timeout or self._header_timeout
        try:
            conn = self._pop_idle(loop.time())
            if conn is None:
                started = loop.time()
                conn = await self._connect(loop, min(self._connect_timeout, timeout))
                timeout -= loop.time() - started
        except BaseException:
            self._gate.release()
            raise
        try:
            self._write(conn, method, target, headers, body, sent)
            await conn.wait_head(timeout)
        except BaseException as exc:
            conn.abort()
            self._gate.release()
            if isinstance(exc, TimeoutError):
                raise UpstreamError(NoAnswer.HEADER_TIMEOUT, "no response headers from D in time") from exc
            if isinstance(exc, OSError | ProtocolError | BodyError):
                raise UpstreamError(NoAnswer.RESET_AFTER_SEND, f"D closed the connection: {exc!r}") from exc
            raise
        return UpstreamResponse(conn, self, self._read_timeout)

    def _write(
        self,
        conn: Connection,
        method: str,
        target: str,
        headers: list[tuple[str, str]],
        body: bytes | AsyncIterator[bytes] | None,
        sent: Sent | None,
    ) -> None:
        if not conn.usable:  # a new connection D closed at once: nothing was written
            raise UpstreamError(NoAnswer.CONNECT_REFUSED, "D closed the connection before the request")
        path = self._prefix + target
        head_only = method == "HEAD"
        if body is None or isinstance(body, bytes):
            payload = body or b""
            head, _, close = encode_head(method, path, self._authority, headers, len(payload))
            if sent is not None:
                sent.may_have_reached_d = True
            conn.begin(head, payload, head_only=head_only, close=close)
        else:
            head, length, close = encode_head(method, path, self._authority, headers, None)
            if sent is not None:
                sent.may_have_reached_d = True
            conn.begin_stream(head, body, length, head_only=head_only, close=close)

    def _pop_idle(self, now: float) -> Connection | None:
        idle = self._idle
        while idle:
            conn, _ = idle.popitem()
            if conn.usable and now - conn.idle_since < KEEPALIVE_SECONDS:
                return conn
            conn.abort()
        return None

    async def _connect(self, loop: asyncio.AbstractEventLoop, budget: float) -> Connection:
        """A new connection; every failure here is before the request could reach D."""
        try:
            async with asyncio.timeout(budget):
                _, conn = await loop.create_connection(
                    lambda: Connection(loop, self._forget), self._host, self._port, ssl=self._ssl
                )
        except TimeoutError as exc:
            raise UpstreamError(NoAnswer.CONNECT_TIMEOUT, "connecting to D timed out") from exc
        except socket.gaierror as exc:
            raise UpstreamError(NoAnswer.DNS, f"cannot resolve D ({self._host}): {exc}") from exc
        except ssl.SSLError as exc:
            raise UpstreamError(NoAnswer.TLS_FAILED, f"the TLS handshake with D failed: {exc}") from exc
        except OSError as exc:
            raise UpstreamError(NoAnswer.CONNECT_REFUSED, f"cannot connect to D: {exc}") from exc
        if self._closed:
            conn.abort()
            raise UpstreamError(NoAnswer.CONNECT_REFUSED, "the upstream client is closed")
        self._conns.add(conn)
        return conn

    async def _wait_for_slot(self) -> None:
        """Wait for a free connection slot, up to ``pool_timeout``."""
        try:
            async with asyncio.timeout(self._pool_timeout):
                await self._gate.acquire()
        except TimeoutError as exc:
            raise UpstreamError(NoAnswer.POOL_TIMEOUT, "no free connection to D in time") from exc

    def _release(self, conn: Connection) -> None:
        """The response is closed: pool its connection if it can carry another request."""
        if conn.reusable and not self._closed:
            assert self._loop is not None
            conn.idle(self._loop.time())
            self._idle[conn] = None
        else:
            conn.abort()
        self._gate.release()

    def _forget(self, conn: Connection) -> None:
        """The transport closed (either side)."""
        self._idle.pop(conn, None)
        self._conns.discard(conn)
