"""The only module that knows which HTTP client library talks to D.

Measured on this project's machines (loopback, 1 and 32 concurrent
requests), one upstream request cost 2.7-4.5 ms of CPU with httpx's default
transport, 0.7-1.0 ms with httpx over the ``httpx-aiohttp`` transport and
0.24-0.45 ms with aiohttp alone. The sidecar's budget is 0.5 ms of proxy CPU
per request in total (server side included), which only aiohttp meets, so
this module uses aiohttp directly and exposes a narrow interface:
``Upstream.send`` returns an ``UpstreamResponse`` whose body is an async
iterator of raw bytes (no decompression, no buffering). Library exceptions
are translated here, once, into ``UpstreamError`` subclasses carrying a
``classify.Failure``: whether the request may have reached D is decided at
this boundary and nowhere else.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Callable
from types import TracebackType

import aiohttp

from sidecar.classify import Failure

Headers = list[tuple[bytes, bytes]]


class Sent:
    """Whether a request may have reached D.

    ``Upstream`` gates requests with its own semaphore sized like the pool,
    so a request waiting for a connection to D is still in the sidecar:
    ``may_have_reached_d`` stays False until it passes the gate. A failure or
    a cancellation before that is a definite "not forwarded". (aiohttp's
    tracing could tell the exact moment the headers leave, but it costs about
    6% of the proxy's CPU per request.)
    """

    __slots__ = ("may_have_reached_d",)

    def __init__(self) -> None:
        self.may_have_reached_d = False


class UpstreamError(Exception):
    """A request to D that produced no response headers."""

    def __init__(self, failure: Failure, detail: str) -> None:
        super().__init__(detail)
        self.failure = failure


class UpstreamResponse:
    """D's status and headers; the body is read with ``chunks()``."""

    def __init__(
        self, response: aiohttp.ClientResponse, read_timeout: float | None, done: Callable[[], None]
    ) -> None:
        self._response = response
        self._read_timeout = read_timeout
        self._done: Callable[[], None] | None = done
        self.status: int = response.status
        self.headers: Headers = list(response.raw_headers)

    async def chunks(self) -> AsyncIterator[bytes]:
        """Body bytes as D sends them. Raises ``UpstreamError`` on a reset or stall."""
        content = self._response.content
        try:
            while True:
                if self._read_timeout:
                    async with asyncio.timeout(self._read_timeout):
                        chunk = await content.readany()
                else:
                    chunk = await content.readany()
                if not chunk:
                    return
                yield chunk
        except TimeoutError as exc:
            raise UpstreamError(Failure.HEADER_TIMEOUT, "D stalled mid-body") from exc
        except (aiohttp.ClientError, ConnectionError) as exc:
            raise UpstreamError(Failure.RESET_AFTER_SEND, f"D reset mid-body: {exc!r}") from exc

    async def read(self, limit: int) -> bytes:
        """Read at most ``limit`` bytes of the body (for small error bodies)."""
        parts: list[bytes] = []
        size = 0
        async for chunk in self.chunks():
            parts.append(chunk)
            size += len(chunk)
            if size >= limit:
                break
        return b"".join(parts)

    def close(self) -> None:
        """Drop the connection unless the body was fully read (D sees an abort)."""
        self._response.close()
        done, self._done = self._done, None
        if done is not None:
            done()

    async def __aenter__(self) -> UpstreamResponse:
        return self

    async def __aexit__(
        self, typ: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class Upstream:
    """A pooled client for one decode server, built once in the lifespan."""

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
        self.base_url = base_url.rstrip("/")
        self._header_timeout = header_timeout
        self._read_timeout = read_timeout or None
        # total=None: streams may run for as long as generation does.
        # Waiting for a pooled connection happens on ``_gate`` (see ``Sent``), not in aiohttp.
        self._timeout = aiohttp.ClientTimeout(
            total=None, connect=connect_timeout, sock_connect=connect_timeout
        )
        self._pool_size = pool_size
        self._pool_timeout = pool_timeout
        self._gate = asyncio.Semaphore(pool_size)
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        connector = aiohttp.TCPConnector(
            limit=self._pool_size, limit_per_host=self._pool_size, ttl_dns_cache=30, keepalive_timeout=30
        )
        self._session = aiohttp.ClientSession(
            connector=connector,
            timeout=self._timeout,
            auto_decompress=False,
            trust_env=False,  # never route to D through an environment proxy
            skip_auto_headers=("User-Agent", "Accept-Encoding", "Content-Type", "Accept"),
            cookie_jar=aiohttp.DummyCookieJar(),
        )

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

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
        """
        assert self._session is not None, "Upstream.start() was not called"
        await self._acquire()
        if sent is not None:
            sent.may_have_reached_d = True
        try:
            async with asyncio.timeout(header_timeout or self._header_timeout):
                response = await self._session.request(
                    method,
                    self.base_url + target,
                    headers=headers,
                    data=body,
                    allow_redirects=False,
                    compress=None,
                    auto_decompress=False,
                )
        except TimeoutError as exc:
            self._gate.release()
            raise UpstreamError(Failure.HEADER_TIMEOUT, "no response headers from D in time") from exc
        except BaseException as exc:
            self._gate.release()
            translated = translate(exc)
            if translated is None:
                raise
            raise translated from exc
        return UpstreamResponse(response, self._read_timeout, self._gate.release)

    async def _acquire(self) -> None:
        """Wait for a free connection slot, up to ``pool_timeout``."""
        if not self._gate.locked():
            await self._gate.acquire()
            return
        try:
            async with asyncio.timeout(self._pool_timeout):
                await self._gate.acquire()
        except TimeoutError as exc:
            raise UpstreamError(Failure.POOL_TIMEOUT, "no free connection to D in time") from exc


def translate(exc: BaseException) -> UpstreamError | None:
    """Map an aiohttp exception raised before headers to a ``Failure``."""
    if isinstance(exc, aiohttp.ClientConnectorDNSError):
        return UpstreamError(Failure.DNS, f"cannot resolve D: {exc}")
    if isinstance(exc, aiohttp.ClientConnectorError):
        os_error = exc.os_error
        if isinstance(os_error, socket.gaierror):
            return UpstreamError(Failure.DNS, f"cannot resolve D: {exc}")
        return UpstreamError(Failure.CONNECT_REFUSED, f"cannot connect to D: {exc}")
    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        return UpstreamError(Failure.CONNECT_TIMEOUT, f"connecting to D timed out: {exc}")
    if isinstance(exc, (aiohttp.ClientError, ConnectionError)):
        return UpstreamError(Failure.RESET_AFTER_SEND, f"D closed the connection: {exc!r}")
    return None
