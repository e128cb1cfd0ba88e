"""A whole answer leaves in one write past the server's response messages, exactly as they would frame it.

``ClientRelay.answer`` (``Cycle.answer``) writes D's head and entire
body at once and ends the response as the server's ``send`` ends one. These
tests run the server's protocol (``GuardedProtocol``) on a recording
transport: the bytes must be what the two ASGI messages would have written,
the cycle must end the same way (keep-alive, ``Connection: close``, the
request count), and every case it cannot frame must write nothing and say so.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from sidecar.transport.relay import RELAY
from tests.support.fakes import FakeTransport, ServerState, guarded_connection

BODY = b'{"id":"cmpl-1","choices":[]}'
HEAD = [
    (b"content-type", b"application/json"),
    (b"content-length", b"%d" % len(BODY)),
    (b"x-request-id", b"req-1"),
]


def request(method: str = "POST", extra: bytes = b"") -> bytes:
    body = b"{}" if method == "POST" else b""
    length = b"content-length: %d\r\n" % len(body) if body else b""
    head = b"%s /v1/chat/completions HTTP/1.1\r\nhost: x\r\n" % method.encode()
    return head + length + extra + b"\r\n" + body


App = Callable[[Any, Any, Any], Awaitable[None]]


async def served(app: App, *requests: bytes) -> tuple[FakeTransport, Any, ServerState]:
    """``requests`` through the sidecar's server protocol answered by ``app``; its transport,
    protocol and server state once every request's task ended."""
    state = ServerState()
    protocol, transport = guarded_connection(app, state=state)
    for data in requests:
        protocol.data_received(data)
        await asyncio.gather(*state.tasks)
        await asyncio.sleep(0)  # a held write leaves at the end of the loop iteration
    return transport, protocol, state


def answering(head: list[tuple[bytes, bytes]], body: bytes, taken: list[bool]) -> App:
    """An app that answers through ``answer`` when it can (``taken`` says whether it did), else
    through the two ASGI messages, as the proxy does."""

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        ok = scope[RELAY].answer(200, list(head), body)
        taken.append(ok)
        if not ok:
            await send({"type": "http.response.start", "status": 200, "headers": list(head)})
            await send({"type": "http.response.body", "body": body, "more_body": False})

    return app


def messages(head: list[tuple[bytes, bytes]], body: bytes) -> App:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": list(head)})
        await send({"type": "http.response.body", "body": body, "more_body": False})

    return app


@pytest.mark.parametrize("extra", [b"", b"connection: close\r\n"], ids=["keep-alive", "client-close"])
async def test_the_bytes_and_the_ending_are_the_asgi_messages_own(extra: bytes) -> None:
    taken: list[bool] = []
    fast, fast_protocol, fast_state = await served(answering(HEAD, BODY, taken), request(extra=extra))
    slow, slow_protocol, slow_state = await served(messages(HEAD, BODY), request(extra=extra))
    assert taken == [True]
    assert bytes(fast.written) == bytes(slow.written)
    assert bytes(fast.written).endswith(b"\r\n\r\n" + BODY)
    assert len(fast.writes) == 1  # head and body together: one socket write
    assert fast.closing == slow.closing == bool(extra)  # the client's Connection: close is honoured
    assert fast_state.total_requests == slow_state.total_requests == 1
    cycle = fast_protocol.cycle
    assert cycle.response_started and cycle.response_complete and not cycle.chunked
    if not extra:
        assert fast_protocol._clock.phase == slow_protocol._clock.phase == "idle"  # the keep-alive clock runs
    fast_protocol.connection_lost(None)
    slow_protocol.connection_lost(None)


async def test_a_keep_alive_connection_serves_the_next_request_after_a_whole_answer() -> None:
    taken: list[bool] = []
    transport, protocol, state = await served(answering(HEAD, BODY, taken), request(), request())
    assert taken == [True, True] and state.total_requests == 2
    assert bytes(transport.written).count(b"HTTP/1.1 200 OK\r\n") == 2
    assert bytes(transport.written).count(BODY) == 2 and not transport.closing
    protocol.connection_lost(None)


async def test_a_head_request_gets_the_head_alone_as_the_asgi_messages_give_it() -> None:
    taken: list[bool] = []
    fast, fast_protocol, _ = await served(answering(HEAD, BODY, taken), request("HEAD"))
    slow, slow_protocol, _ = await served(messages(HEAD, BODY), request("HEAD"))
    assert taken == [True] and bytes(fast.written) == bytes(slow.written)
    written = bytes(fast.written)
    assert b"content-length: %d\r\n" % len(BODY) in written and written.endswith(b"\r\n\r\n")  # no body
    fast_protocol.connection_lost(None)
    slow_protocol.connection_lost(None)


HEADLESS = [(n, v) for n, v in HEAD if n != b"content-length"]


@pytest.mark.parametrize(
    ("method", "head"),
    [
        ("POST", HEADLESS),  # no length named: the server would frame it chunked
        ("POST", [*HEADLESS, (b"content-length", b"3")]),  # a length that is not the body's
        ("POST", [*HEAD, (b"content-length", b"%d" % len(BODY))]),  # named twice
        ("POST", [*HEAD, (b"transfer-encoding", b"chunked")]),
    ],
    ids=["no-length", "wrong-length", "two-lengths", "chunked"],
)
async def test_what_it_cannot_frame_is_left_to_the_server_and_nothing_is_written(
    method: str, head: list[tuple[bytes, bytes]]
) -> None:
    outcomes: list[tuple[bool, int, bool]] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        before = len(transport.writes)
        ok = scope[RELAY].answer(200, list(head), BODY)
        outcomes.append((ok, len(transport.writes) - before, protocol.cycle.response_started))

    protocol, transport = guarded_connection(app)
    protocol.data_received(request(method))
    await asyncio.gather(*protocol.state.tasks)
    assert outcomes == [(False, 0, False)]  # refused, nothing written, the response not begun
    protocol.connection_lost(None)


async def test_a_response_already_started_or_a_client_gone_is_refused() -> None:
    outcomes: list[bool] = []

    async def started(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": list(HEAD)})
        outcomes.append(scope[RELAY].answer(200, list(HEAD), BODY))
        await send({"type": "http.response.body", "body": BODY})

    transport, protocol, _ = await served(started, request())
    assert outcomes == [False] and bytes(transport.written).count(BODY) == 1
    protocol.connection_lost(None)

    async def gone(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        protocol.connection_lost(None)  # the client left while D answered
        outcomes.append(scope[RELAY].answer(200, list(HEAD), BODY))

    protocol, transport = guarded_connection(gone)
    protocol.data_received(request())
    await asyncio.gather(*protocol.state.tasks)
    assert outcomes == [False, False] and BODY not in bytes(transport.written)


async def test_a_client_that_reads_nothing_gets_the_answer_through_the_server() -> None:
    # The client's transport is over its high-water mark: the server's send waits for it to drain;
    # a whole answer must not jump that queue.
    outcomes: list[bool] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        protocol.pause_writing()
        outcomes.append(scope[RELAY].answer(200, list(HEAD), BODY))
        protocol.resume_writing()
        await send({"type": "http.response.start", "status": 200, "headers": list(HEAD)})
        await send({"type": "http.response.body", "body": BODY})

    protocol, transport = guarded_connection(app)
    protocol.data_received(request())
    await asyncio.gather(*protocol.state.tasks)
    assert outcomes == [False] and bytes(transport.written).endswith(BODY)
    protocol.connection_lost(None)
