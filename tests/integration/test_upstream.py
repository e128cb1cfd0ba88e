"""``sidecar.upstream`` against real servers on loopback: uvicorn apps and raw asyncio sockets.

Every test runs on both event loops the sidecar meets: asyncio (the test
servers) and uvloop (``kv-release-sidecar serve``). Raw servers run on the
test's own loop, so what they saw is checked without threads.
"""

from __future__ import annotations

import asyncio
import gzip
import hashlib
import inspect
import socket
import subprocess
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any

import httptools
import pytest
import uvloop
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from sidecar.classify import NoAnswer
from sidecar.sim.servers import ServerThread, serve
from sidecar.upstream import Sent, Upstream, UpstreamError, UpstreamResponse
from sidecar.upstream.http1 import HIGH_WATER
from tests.support.fakes import CountingLoop
from tests.support.ports import free_port

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
MiB = 1024 * 1024


def on_both_loops(test: Callable[..., Coroutine[Any, Any, None]]) -> Callable[..., None]:
    """Run an ``async def`` test once on asyncio's loop and once on uvloop's.

    pytest-asyncio takes its loop from a conftest hook; this module brings its own runner instead.
    """

    def run(*args: Any, loop: str, **kwargs: Any) -> None:
        factory = uvloop.new_event_loop if loop == "uvloop" else asyncio.new_event_loop
        with asyncio.Runner(loop_factory=factory) as runner:
            runner.run(test(*args, **kwargs))

    signature = inspect.signature(test)
    loop = inspect.Parameter("loop", inspect.Parameter.KEYWORD_ONLY)
    run.__signature__ = signature.replace(parameters=[*signature.parameters.values(), loop])  # type: ignore[attr-defined]
    run.__name__, run.__qualname__, run.__doc__ = test.__name__, test.__qualname__, test.__doc__
    run.__module__ = test.__module__
    run.pytestmark = list(getattr(test, "pytestmark", []))  # type: ignore[attr-defined]
    parametrized: Callable[..., None] = pytest.mark.parametrize("loop", ["asyncio", "uvloop"])(run)
    return parametrized


def upstream(url: str, **overrides: float) -> Upstream:
    settings: dict[str, float] = {
        "connect_timeout": 2.0,
        "pool_timeout": 2.0,
        "header_timeout": 5.0,
        "read_timeout": 0.0,
        "pool_size": 8,
    }
    settings.update(overrides)
    return Upstream(
        url,
        connect_timeout=settings["connect_timeout"],
        pool_timeout=settings["pool_timeout"],
        header_timeout=settings["header_timeout"],
        read_timeout=settings["read_timeout"],
        pool_size=int(settings["pool_size"]),
    )


async def started(url: str, **overrides: float) -> Upstream:
    client = upstream(url, **overrides)
    await client.start()
    return client


async def body_of(response: UpstreamResponse) -> bytes:
    async with response:
        return b"".join([chunk async for chunk in response.chunks()])


class RawServer:
    """An asyncio TCP server on an ephemeral port; ``handler`` runs once per accepted connection."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.accepted = 0
        self.closed = asyncio.Event()  # set each time a handler finishes
        self.port = 0
        self._server: asyncio.Server | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def __aenter__(self) -> RawServer:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        try:
            await self.handler(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()
            self.closed.set()


async def read_request(reader: asyncio.StreamReader) -> bytes:
    """One request head plus its content-length body."""
    head = await reader.readuntil(b"\r\n\r\n")
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return head + await reader.readexactly(int(line.split(b":")[1]))
    return head


def response(body: bytes, *extra: bytes) -> bytes:
    head = b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n" % len(body) + b"".join(h + b"\r\n" for h in extra)
    return head + b"\r\n" + body


async def answer_ok(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """A keep-alive D answering every request with ``ok``."""
    while await read_request(reader):
        writer.write(response(b"ok"))


# -- keep-alive ----------------------------------------------------------------------------------


def client_port_app() -> Starlette:
    async def port(request: Request) -> Response:
        assert request.client is not None
        return JSONResponse({"port": request.client.port})

    return Starlette(routes=[Route("/port", port)])


@pytest.fixture(scope="module")
def port_server() -> Iterator[ServerThread]:
    with serve(client_port_app()) as server:
        yield server


@on_both_loops
async def test_connections_are_reused_and_bounded_by_the_pool(port_server: ServerThread) -> None:
    client = await started(port_server.url, pool_size=4)
    try:

        async def port() -> bytes:
            return await body_of(await client.send("GET", "/port", [], None))

        sequential = {await port() for _ in range(20)}
        assert len(sequential) == 1
        for _ in range(3):
            concurrent = set(await asyncio.gather(*(port() for _ in range(16))))
            assert len(concurrent) <= 4
        assert len(client._conns) <= 4
    finally:
        await client.close()


@on_both_loops
async def test_connection_close_from_d_is_not_reused() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(response(b"bye", b"connection: close"))
        await reader.read()  # until the client closes its side

    async with RawServer(handler) as server:
        client = await started(server.url)
        for _ in range(3):
            assert await body_of(await client.send("GET", "/", [], None)) == b"bye"
        await client.close()
    assert server.accepted == 3


@on_both_loops
async def test_unread_but_complete_response_keeps_the_connection() -> None:
    requests = 0

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal requests
        while await read_request(reader):
            requests += 1
            writer.write(response(b"ok"))

    async with RawServer(handler) as server:
        client = await started(server.url)
        for _ in range(5):
            async with await client.send("GET", "/health", [], None) as answer:
                assert answer.status == 200  # body never read, like the readiness check
        await client.close()
    assert (server.accepted, requests) == (1, 5)


# -- response bodies -----------------------------------------------------------------------------

BODIES = {
    "content-length": (b"HTTP/1.1 200 OK\r\ncontent-length: 11\r\n\r\nhello world", True),
    "chunked": (
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n",
        True,
    ),
    "until close": (b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\nhello world", False),
    "until close, HTTP/1.0": (b"HTTP/1.0 200 OK\r\n\r\nhello world", False),
}


@on_both_loops
@pytest.mark.parametrize("name", list(BODIES))
async def test_response_framing(name: str) -> None:
    raw, keep_alive = BODIES[name]

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while await read_request(reader):
            for i in range(0, len(raw), 7):  # in pieces, so llhttp sees split frames
                writer.write(raw[i : i + 7])
                await writer.drain()
            if not keep_alive:
                return

    async with RawServer(handler) as server:
        client = await started(server.url)
        for _ in range(3):
            answer = await client.send("GET", "/", [], None)
            assert answer.status == 200
            assert await body_of(answer) == b"hello world"
        await client.close()
    assert server.accepted == (1 if keep_alive else 3)


def gzip_app() -> Starlette:
    async def zipped(request: Request) -> Response:
        return Response(gzip.compress(b"x" * 5000), headers={"content-encoding": "gzip"})

    return Starlette(routes=[Route("/z", zipped)])


@on_both_loops
async def test_gzip_passes_through_undecoded() -> None:
    with serve(gzip_app()) as server:
        client = await started(server.url)
        answer = await client.send("GET", "/z", [("accept-encoding", "gzip")], None)
        assert (b"content-encoding", b"gzip") in answer.headers
        assert gzip.decompress(await body_of(answer)) == b"x" * 5000
        await client.close()


@on_both_loops
async def test_head_has_no_body_and_the_connection_is_reused() -> None:
    seen: list[bytes] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while head := await read_request(reader):
            seen.append(head.split(b" ")[0])
            if head.startswith(b"HEAD"):
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 1234\r\n\r\n")
            else:
                writer.write(response(b"full"))

    async with RawServer(handler) as server:
        client = await started(server.url)
        head = await client.send("HEAD", "/", [], None)
        assert (b"content-length", b"1234") in head.headers
        assert await body_of(head) == b""
        assert await body_of(await client.send("GET", "/", [], None)) == b"full"
        await client.close()
    assert seen == [b"HEAD", b"GET"] and server.accepted == 1


@on_both_loops
async def test_a_keep_alive_connection_keeps_one_parser_and_one_timer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    made = 0
    parser = httptools.HttpResponseParser

    def counted(protocol: object) -> Any:
        nonlocal made
        made += 1
        return parser(protocol)

    monkeypatch.setattr(httptools, "HttpResponseParser", counted)

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while await read_request(reader):  # the body's end comes later: the client waits for it too
            writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\nok\r\n")
            await writer.drain()
            await asyncio.sleep(0.001)
            writer.write(b"0\r\n\r\n")

    async with RawServer(handler) as server:
        client = await started(server.url, read_timeout=5.0)
        loop = CountingLoop(asyncio.get_running_loop())
        client._loop = loop  # type: ignore[assignment]
        for _ in range(20):
            assert await body_of(await client.send("GET", "/", [], None)) == b"ok"
        await client.close()
    assert server.accepted == 1 and made == 1
    assert loop.timers <= 2  # forty waits for D (head, body) on one timer, moved at most once


@on_both_loops
async def test_each_wait_for_d_keeps_its_own_limit_on_the_shared_timer() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(response(b"ok"))
        await read_request(reader)
        await asyncio.sleep(0.6)
        writer.write(response(b"late"))
        await reader.read()  # the third request is never answered

    async with RawServer(handler) as server:
        client = await started(server.url, header_timeout=0.3)
        assert await body_of(await client.send("GET", "/", [], None)) == b"ok"
        # the timer set for the first wait (0.3 s) fires during this one, which has 5 s
        assert await body_of(await client.send("GET", "/", [], None, header_timeout=5.0)) == b"late"
        sent_at = time.monotonic()
        with pytest.raises(UpstreamError) as caught:  # the timer is now set 5 s out: 0.2 s moves it
            await client.send("GET", "/", [], None, header_timeout=0.2)
        assert caught.value.failure is NoAnswer.HEADER_TIMEOUT
        # Left where it was, the timer would fire about 4.4 s after sent_at: the bound keeps 0.4 s of
        # that and gives the 0.2 s wait 3.8 s of margin on a loaded machine.
        assert time.monotonic() - sent_at < 4.0
        await client.close()


@on_both_loops
async def test_interim_100_continue_is_skipped() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        await reader.readexactly(5)
        writer.write(b"HTTP/1.1 103 Early Hints\r\nlink: </a>\r\n\r\n" + response(b"done", b"x-final: 1"))
        await reader.read()

    async with RawServer(handler) as server:
        client = await started(server.url)
        answer = await client.send("POST", "/", [("expect", "100-continue")], b"hello")
        assert answer.status == 200
        assert answer.headers == [(b"content-length", b"4"), (b"x-final", b"1")]
        assert await body_of(answer) == b"done"
        await client.close()


@on_both_loops
async def test_expect_100_continue_against_uvicorn() -> None:
    async def echo(request: Request) -> Response:
        return Response(await request.body())

    with serve(Starlette(routes=[Route("/e", echo, methods=["POST"])])) as server:
        client = await started(server.url)
        answer = await client.send("POST", "/e", [("expect", "100-continue")], b"payload")
        assert (answer.status, await body_of(answer)) == (200, b"payload")
        await client.close()


# -- stale connections ---------------------------------------------------------------------------


@on_both_loops
async def test_connection_closed_by_d_while_idle_is_not_handed_out() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(response(b"once"))  # keep-alive, then closed as if its idle timeout ran out

    async with RawServer(handler) as server:
        client = await started(server.url)
        assert await body_of(await client.send("GET", "/", [], None)) == b"once"
        await server.closed.wait()
        for _ in range(200):  # until the client saw the EOF (polled, bounded)
            if not client._idle:
                break
            await asyncio.sleep(0.005)
        assert not client._idle
        sent = Sent()
        assert await body_of(await client.send("POST", "/", [], b"{}", sent=sent)) == b"once"
        await client.close()
    assert server.accepted == 2


@on_both_loops
async def test_connection_idle_beyond_the_keepalive_is_not_reused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("sidecar.upstream.client.KEEPALIVE_SECONDS", 0.0)
    async with RawServer(answer_ok) as server:
        client = await started(server.url)
        for _ in range(2):
            assert await body_of(await client.send("GET", "/", [], None)) == b"ok"
        await client.close()
    assert server.accepted == 2


@on_both_loops
async def test_keepalive_age_counts_from_ds_last_byte_not_from_the_release(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # D's keep-alive timer starts when D finished writing. A response the sidecar releases only
    # later (a slow client still reading it) must not look freshly idle: reusing a connection
    # D is closing turns a request D never got into an ambiguous RESET_AFTER_SEND.
    monkeypatch.setattr("sidecar.upstream.client.KEEPALIVE_SECONDS", 0.2)
    async with RawServer(answer_ok) as server:
        client = await started(server.url)
        answer = await client.send("GET", "/", [], None)
        async for _ in answer.chunks():  # read to the end: the exchange is complete
            pass
        await asyncio.sleep(0.3)  # the client is slow; the response is released only now
        answer.close()
        assert await body_of(await client.send("GET", "/", [], None)) == b"ok"
        await client.close()
    assert server.accepted == 2


@on_both_loops
async def test_close_racing_the_send_is_reset_after_send_and_never_retried() -> None:
    requests: list[bytes] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        requests.append(await read_request(reader))
        writer.write(response(b"first"))
        requests.append(await read_request(reader))  # the second request arrives, then D goes away

    async with RawServer(handler) as server:
        client = await started(server.url)
        assert await body_of(await client.send("POST", "/", [], b"1")) == b"first"
        sent = Sent()
        with pytest.raises(UpstreamError) as caught:
            await client.send("POST", "/", [], b"2", sent=sent)
        assert caught.value.failure is NoAnswer.RESET_AFTER_SEND
        assert sent.may_have_reached_d
        await client.close()
    assert server.accepted == 1 and len(requests) == 2  # no second copy on a new connection


# -- failures before D could have the request ----------------------------------------------------


@on_both_loops
async def test_refused_port_is_connect_refused() -> None:
    client = await started(f"http://127.0.0.1:{free_port()}")
    sent = Sent()
    with pytest.raises(UpstreamError) as caught:
        await client.send("POST", "/v1/completions", [], b"{}", sent=sent)
    assert caught.value.failure is NoAnswer.CONNECT_REFUSED
    assert not sent.may_have_reached_d
    await client.close()


@on_both_loops
async def test_unresolvable_host_is_dns() -> None:
    client = await started("http://no-such-host.invalid:8200")
    sent = Sent()
    with pytest.raises(UpstreamError) as caught:
        await client.send("GET", "/health", [], None, sent=sent)
    assert caught.value.failure is NoAnswer.DNS
    assert not sent.may_have_reached_d
    await client.close()


@on_both_loops
async def test_pool_exhaustion_is_pool_timeout_and_never_sent() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        await reader.read()  # the body never comes

    async with RawServer(handler) as server:
        client = await started(server.url, pool_size=1, pool_timeout=0.1)
        held = await client.send("GET", "/stream", [], None)
        sent = Sent()
        with pytest.raises(UpstreamError) as caught:
            await client.send("POST", "/v1/completions", [], b"{}", sent=sent)
        assert caught.value.failure is NoAnswer.POOL_TIMEOUT
        assert not sent.may_have_reached_d
        held.close()
        await client.close()
    assert server.accepted == 1


# -- failures after sending ----------------------------------------------------------------------


@on_both_loops
async def test_silent_listener_is_header_timeout_after_the_request_was_written() -> None:
    with socket.create_server(("127.0.0.1", 0)) as listener:  # listens, never accepts nor answers
        client = await started(f"http://127.0.0.1:{listener.getsockname()[1]}", header_timeout=0.2)
        sent = Sent()
        with pytest.raises(UpstreamError) as caught:
            await client.send("POST", "/v1/completions", [], b"{}", sent=sent)
        assert caught.value.failure is NoAnswer.HEADER_TIMEOUT
        assert sent.may_have_reached_d
        await client.close()


@on_both_loops
async def test_reset_before_headers_is_reset_after_send() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-le")  # half a head, then gone

    async with RawServer(handler) as server:
        client = await started(server.url)
        with pytest.raises(UpstreamError) as caught:
            await client.send("GET", "/", [], None)
        assert caught.value.failure is NoAnswer.RESET_AFTER_SEND
        await client.close()


@on_both_loops
@pytest.mark.parametrize("how", ["eof", "rst"])
async def test_mid_body_break_is_reset_after_send_from_chunks(how: str) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n0123456789")
        await writer.drain()
        if how == "rst":
            sock = writer.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")

    async with RawServer(handler) as server:
        client = await started(server.url)
        answer = await client.send("GET", "/", [], None)
        received = b""
        with pytest.raises(UpstreamError) as caught:
            async for chunk in answer.chunks():
                received += chunk
        assert caught.value.failure is NoAnswer.RESET_AFTER_SEND
        assert received in (b"", b"0123456789")
        answer.close()
        await client.close()


@on_both_loops
async def test_read_timeout_bounds_the_gap_between_chunks() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nfirst\r\n")
        await reader.read()  # then stalls

    async with RawServer(handler) as server:
        client = await started(server.url, read_timeout=0.2)
        answer = await client.send("GET", "/", [], None)
        chunks = answer.chunks()
        assert await anext(chunks) == b"first"
        with pytest.raises(UpstreamError) as caught:
            await anext(chunks)
        assert caught.value.failure is NoAnswer.HEADER_TIMEOUT
        answer.close()
        await client.close()


@on_both_loops
async def test_closing_a_partly_read_response_closes_the_connection() -> None:
    gone = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nfirst\r\n")
        if await reader.read() == b"":  # EOF: the client dropped the connection
            gone.set()

    async with RawServer(handler) as server:
        client = await started(server.url)
        answer = await client.send("GET", "/", [], None)
        assert await anext(answer.chunks()) == b"first"
        answer.close()
        await asyncio.wait_for(gone.wait(), 5)
        assert not client._conns
        await client.close()


@on_both_loops
async def test_cancelled_send_drops_the_connection_and_frees_the_slot() -> None:
    requests = 0

    arrived = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal requests
        await read_request(reader)
        requests += 1
        arrived.set()
        if requests > 1:
            writer.write(response(b"second"))
        await reader.read()

    async with RawServer(handler) as server:
        client = await started(server.url, pool_size=1, pool_timeout=0.5)
        task = asyncio.create_task(client.send("GET", "/slow", [], None))
        await asyncio.wait_for(arrived.wait(), 5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.wait_for(server.closed.wait(), 5)  # the server saw the abort
        assert await body_of(await client.send("GET", "/", [], None)) == b"second"
        await client.close()


# -- large bodies and flow control ---------------------------------------------------------------


def digest_app() -> Starlette:
    async def digest(request: Request) -> Response:
        hasher, size = hashlib.sha256(), 0
        async for chunk in request.stream():
            hasher.update(chunk)
            size += len(chunk)
        return JSONResponse({"sha256": hasher.hexdigest(), "size": size, "te": request.headers.get("te")})

    return Starlette(routes=[Route("/digest", digest, methods=["POST"])])


@on_both_loops
@pytest.mark.parametrize("declared", [False, True], ids=["chunked", "content-length"])
async def test_large_streamed_upload_arrives_intact(declared: bool) -> None:
    block = hashlib.sha256(b"seed").digest() * (MiB // 32)
    expected = hashlib.sha256(block * 20).hexdigest()

    async def body() -> AsyncIterator[bytes]:
        for _ in range(20):
            yield block

    headers = [("content-length", str(20 * MiB))] if declared else []
    with serve(digest_app()) as server:
        client = await started(server.url)
        answer = await client.send("POST", "/digest", headers, body())
        assert answer.status == 200
        assert b'"size":%d' % (20 * MiB) in await body_of(answer)
        assert expected.encode() in (await body_of(await client.send("POST", "/digest", headers, body())))
        await client.close()


@on_both_loops
async def test_upload_respects_write_flow_control() -> None:
    buffered: list[int] = []
    received = 0

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal received
        await reader.readuntil(b"\r\n\r\n")
        while received < 16 * MiB:
            data = await reader.read(64 * 1024)
            if not data:
                return
            received += len(data)
            await asyncio.sleep(0.0005)  # a slow reader
        writer.write(response(b"ok"))
        await reader.read()

    async with RawServer(handler) as server:
        client = await started(server.url)

        async def body() -> AsyncIterator[bytes]:
            for _ in range(16):
                conn = next(iter(client._conns))
                assert conn.transport is not None
                buffered.append(conn.transport.get_write_buffer_size())
                yield b"u" * MiB

        answer = await client.send("POST", "/", [("content-length", str(16 * MiB))], body())
        assert await body_of(answer) == b"ok"
        await client.close()
    assert received == 16 * MiB
    assert max(buffered) <= 2 * MiB  # without flow control it grows towards 16 MiB


@on_both_loops
async def test_slow_consumer_pauses_reading_so_buffering_stays_bounded() -> None:
    size = 50 * MiB
    block = b"r" * MiB

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % size)
        for _ in range(size // MiB):
            writer.write(block)
            await writer.drain()

    async with RawServer(handler) as server:
        client = await started(server.url)
        answer = await client.send("GET", "/big", [], None)
        conn = answer._conn
        total, peak = 0, 0
        async with answer:
            async for chunk in answer.chunks():
                total += len(chunk)
                await asyncio.sleep(0.001)  # slower than loopback
                peak = max(peak, conn.buffered)
        await client.close()
    assert total == size
    assert peak <= HIGH_WATER + 512 * 1024


# -- https ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    folder = tmp_path_factory.mktemp("tls")
    cert, key = folder / "cert.pem", folder / "key.pem"
    try:
        subprocess.run(
            [
                *("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1"),
                *("-keyout", str(key), "-out", str(cert), "-subj", "/CN=127.0.0.1"),
                *("-addext", "subjectAltName=IP:127.0.0.1"),
            ],
            check=True,
            capture_output=True,
        )
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"openssl cannot make a test certificate: {exc}")
    return cert, key


@on_both_loops
async def test_https_verifies_d_with_the_system_trust_store(
    tls_files: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    cert, key = tls_files
    with serve(client_port_app(), ssl_certfile=str(cert), ssl_keyfile=str(key)) as server:
        url = f"https://127.0.0.1:{server.port}"
        untrusted = await started(url)
        with pytest.raises(UpstreamError) as caught:
            await untrusted.send("GET", "/port", [], None)
        assert caught.value.failure is NoAnswer.TLS_FAILED  # nothing was sent: released like refused
        monkeypatch.setenv("SSL_CERT_FILE", str(cert))  # read by OpenSSL when the context is built
        client = await started(url)
        ports = {await body_of(await client.send("GET", "/port", [], None)) for _ in range(3)}
        assert len(ports) == 1
        await client.close()
