"""GuardedProtocol driven by hand on a fake transport: its body timer against its own flow
control, and how a response's head and body reach the socket.

The timer and the read that resumes a held-back body can fall in the same loop
iteration, and a head held for its body must leave at the end of the iteration
that wrote it; only a hand-driven protocol makes that order certain.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from sidecar.asgi import DISCONNECT_HUB, DisconnectHub
from sidecar.proxy.disconnect import DisconnectWatcher
from sidecar.server.limits import ServerLimits
from sidecar.server.protocol import GuardedProtocol
from tests.support.fakes import CountingLoop, FakeTransport, ServerState, guarded_connection

HEAD = b"POST /v1/files HTTP/1.1\r\nhost: x\r\ncontent-length: 1000000\r\n\r\n"


async def _holding_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    await asyncio.Event().wait()  # never reads the body: the server holds reading back


def _connect(limits: ServerLimits, app: Any = _holding_app) -> tuple[GuardedProtocol, FakeTransport]:
    return guarded_connection(app, limits)


def _tasks(protocol: GuardedProtocol) -> set[asyncio.Task[None]]:
    return protocol.state.tasks


async def test_a_body_timer_due_as_reading_resumes_does_not_blame_the_client() -> None:
    protocol, transport = _connect(ServerLimits(body_timeout=1.0))
    protocol.data_received(HEAD + b"x" * 70_000)  # past the server's high water mark
    assert protocol._read_paused and not transport.reading
    protocol._clock.since -= 10.0  # the server held reading back for ten body timeouts
    assert protocol.cycle is not None
    protocol.cycle.body.clear()  # the app reads again; the client's bytes arrive next iteration
    protocol.body_taken()
    assert transport.reading
    protocol._clock._fired()  # ...after a body timer due this very iteration
    assert not transport.closing and bytes(transport.written) == b""
    protocol._clock.since -= 1.5  # the client then really stays silent past the timeout
    protocol._clock._fired()
    assert transport.closing and transport.written.startswith(b"HTTP/1.1 408 ")
    await _close(protocol)


async def test_a_body_timer_while_reading_is_held_back_restarts_the_clients_gap() -> None:
    protocol, transport = _connect(ServerLimits(body_timeout=1.0))
    protocol.data_received(HEAD + b"x" * 70_000)
    protocol._clock.since -= 10.0
    protocol._clock._fired()  # reading is paused: the wait is the server's
    assert not transport.closing
    assert protocol.loop.time() - protocol._clock.since < 0.5
    await _close(protocol)


async def test_a_pipelined_head_is_not_charged_for_the_body_read_before_it() -> None:
    # One read: a 100 kB body, then the start of the next request's head. Counting the whole
    # read as head answered a silent 431 and cut the first request off.
    protocol, transport = _connect(ServerLimits(max_header_bytes=16 * 1024))
    try:
        body = b"x" * 100_000
        first = b"POST /v1/files HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n" % len(body) + body
        protocol.data_received(first + b"GET /health HTTP/1.1\r\nhost: x\r\n")
        assert not transport.closing and not transport.written
        assert protocol.cycle is not None and not protocol.cycle.disconnected
        # the next read of that head still counts: an endless head is still refused, once the
        # first request's answer is out (reading stops meanwhile)
        protocol.data_received(b"x-pad: " + b"y" * 20_000 + b"\r\n")
        assert not transport.closing and not transport.reading and not transport.written
        protocol.data_received(b"GET /more HTTP/1.1\r\n")  # dropped: nothing more is parsed
        await protocol.cycle.send({"type": "http.response.start", "status": 200, "headers": JSON_HEAD})
        await protocol.cycle.send({"type": "http.response.body", "body": b'{"id": "a"}'})
        assert transport.closing
        first, refusal = bytes(transport.written).split(b"HTTP/1.1 431 ")
        assert first.startswith(b"HTTP/1.1 200 OK\r\n") and b"exceeds the limit" in refusal
        assert b"/more" not in bytes(transport.written)
    finally:
        await _close(protocol)


async def _close(protocol: GuardedProtocol) -> None:
    protocol.connection_lost(None)
    for task in _tasks(protocol):
        task.cancel()
    await asyncio.gather(*_tasks(protocol), return_exceptions=True)


REQUEST = b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\n{}"
SSE_HEAD = [(b"content-type", b"text/event-stream")]
JSON_HEAD = [(b"content-type", b"application/json"), (b"content-length", b"11")]


@pytest.mark.parametrize("body", [b'{"id": "a"}', b"x" * 200_000], ids=["small", "large"])
async def test_a_whole_answer_leaves_in_one_write(body: bytes) -> None:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        head = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
        await send({"type": "http.response.start", "status": 200, "headers": head})
        await send({"type": "http.response.body", "body": body, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    protocol, transport = _connect(ServerLimits(), app)
    try:
        protocol.data_received(REQUEST)
        await asyncio.gather(*_tasks(protocol))
        assert len(transport.writes) == 1
        assert transport.writes[0].startswith(b"HTTP/1.1 200 OK\r\n")
        assert transport.writes[0].endswith(b"\r\n\r\n" + body)
        # the next request on the connection is coalesced the same way
        protocol.data_received(REQUEST)
        await asyncio.gather(*_tasks(protocol))
        assert len(transport.writes) == 2 and transport.writes[1] == transport.writes[0]
    finally:
        await _close(protocol)


async def test_a_streamed_head_leaves_at_the_end_of_its_loop_iteration() -> None:
    started, release = asyncio.Event(), asyncio.Event()

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": SSE_HEAD})
        started.set()
        await release.wait()  # the first event is still on its way from D
        await send({"type": "http.response.body", "body": b"data: 1\n\n", "more_body": True})
        await send({"type": "http.response.body", "body": b"data: 2\n\n", "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    protocol, transport = _connect(ServerLimits(), app)
    try:
        protocol.data_received(REQUEST)
        await started.wait()  # woken after the iteration that wrote the head
        assert len(transport.writes) == 1 and transport.writes[0].startswith(b"HTTP/1.1 200 OK\r\n")
        assert transport.writes[0].endswith(b"transfer-encoding: chunked\r\n\r\n")
        release.set()
        await asyncio.gather(*_tasks(protocol))
        # every event leaves as it is sent, none held for the next
        assert transport.writes[1:] == [b"9\r\ndata: 1\n\n\r\n", b"9\r\ndata: 2\n\n\r\n", b"0\r\n\r\n"]
    finally:
        await _close(protocol)


async def test_a_held_head_leaves_with_a_large_body_in_one_call_and_not_after_a_close() -> None:
    body = b"x" * 100_000

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        head = [(b"content-length", b"%d" % len(body))]
        await send({"type": "http.response.start", "status": 200, "headers": head})
        await send({"type": "http.response.body", "body": body})

    async def cut(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": JSON_HEAD})
        protocol.transport.close()  # before the loop iteration ends: no half answer is written

    protocol, transport = _connect(ServerLimits(), app)
    try:
        protocol.data_received(REQUEST)
        await asyncio.gather(*_tasks(protocol))
        assert len(transport.writes) == 1 and transport.writes[0].endswith(b"\r\n\r\n" + body)
    finally:
        await _close(protocol)
    protocol, transport = _connect(ServerLimits(), cut)
    try:
        protocol.data_received(REQUEST)
        await asyncio.gather(*_tasks(protocol))
        await asyncio.sleep(0)  # the flush the head scheduled finds the connection closing
        assert transport.closing and transport.writes == []
    finally:
        await _close(protocol)


async def _answer(scope: Any, receive: Any, send: Any) -> None:
    await receive()
    await send({"type": "http.response.start", "status": 200, "headers": JSON_HEAD})
    await send({"type": "http.response.body", "body": b'{"id": "a"}', "more_body": False})


async def test_a_busy_keep_alive_connection_starts_no_timer_per_request() -> None:
    loop = CountingLoop(asyncio.get_running_loop())
    protocol, transport = guarded_connection(_answer, state=ServerState(), loop=loop)
    try:
        for _ in range(20):  # head, body and keep-alive clocks, twenty times over
            protocol.data_received(REQUEST)
            await asyncio.gather(*_tasks(protocol))
        assert len(transport.writes) == 20 and not transport.closing
        assert loop.timers <= 2  # the connection's timer, moved once to the keep-alive limit
    finally:
        await _close(protocol)


async def test_the_keep_alive_clock_runs_after_a_body_the_answer_did_not_wait_for() -> None:
    async def early(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": JSON_HEAD})
        await send({"type": "http.response.body", "body": b'{"id": "a"}', "more_body": False})

    protocol, transport = _connect(ServerLimits(keep_alive=1.0), early)
    try:
        protocol.data_received(HEAD + b"x" * 1000)
        await asyncio.gather(*_tasks(protocol))  # answered; the body is still arriving
        protocol.data_received(b"x" * (1_000_000 - 1000))
        assert protocol._clock.phase == "idle" and protocol._clock._timer.armed
        protocol._clock.since -= 0.5
        protocol._clock._fired()  # half the keep-alive limit: still open
        assert not transport.closing
        protocol._clock.since -= 1.0
        protocol._clock._fired()  # the client stayed silent past it: closed quietly
        assert transport.closing and len(transport.writes) == 1
    finally:
        await _close(protocol)


async def test_a_shorter_limit_than_the_one_the_timer_waits_for_is_kept() -> None:
    # after an answer the timer waits for the 5 s keep-alive; a head begun then has 0.05 s
    protocol, transport = _connect(ServerLimits(header_timeout=0.05, keep_alive=5.0), _answer)
    try:
        protocol.data_received(REQUEST)
        await asyncio.gather(*_tasks(protocol))
        await asyncio.sleep(0.2)  # the client idles past the first head's limit: the timer now waits 5 s
        protocol.data_received(b"GET /health HT")
        await asyncio.wait_for(transport.closed.wait(), 2.0)
        assert transport.writes[-1].startswith(b"HTTP/1.1 408 ")
    finally:
        await _close(protocol)


async def test_a_lost_connection_cancels_the_requests_watching_it_with_no_task_of_their_own() -> None:
    """The server puts the connection's ``DisconnectHub`` in each request's scope; a watcher
    registers there instead of starting a task, and the connection's loss cancels it."""
    outcome: list[str] = []
    started = asyncio.Event()

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await receive()  # the whole body
        tasks_before = len(asyncio.all_tasks())
        watcher = DisconnectWatcher(receive, hub=scope[DISCONNECT_HUB])
        assert len(asyncio.all_tasks()) == tasks_before  # no watcher task
        started.set()
        try:
            await asyncio.Event().wait()  # D generating
        except asyncio.CancelledError:
            outcome.append("cancelled")
            raise
        finally:
            watcher.stop()

    protocol, _ = _connect(ServerLimits(), app)
    protocol.data_received(REQUEST)
    await asyncio.wait_for(started.wait(), 5)
    protocol.connection_lost(None)
    await asyncio.gather(*_tasks(protocol), return_exceptions=True)
    assert outcome == ["cancelled"]


async def test_a_request_that_watches_after_its_client_left_is_cancelled_at_once() -> None:
    hub = DisconnectHub()
    hub.lost()
    owner = asyncio.current_task()
    assert owner is not None
    watcher = DisconnectWatcher(_never, hub=hub)
    with pytest.raises(asyncio.CancelledError):
        await asyncio.sleep(1)
    owner.uncancel()
    assert watcher.fired
    watcher.stop()


async def test_a_stopped_watcher_is_no_longer_told() -> None:
    hub = DisconnectHub()
    watcher = DisconnectWatcher(_never, hub=hub)
    watcher.stop()
    assert not hub._callbacks  # the connection no longer holds the finished request's watcher
    hub.lost()
    await asyncio.sleep(0)  # no cancellation arrives
    assert not watcher.fired


async def _cancelled() -> None:
    """This task is cancelled at its next wait (taken back once seen)."""
    with pytest.raises(asyncio.CancelledError):
        await asyncio.sleep(1)
    owner = asyncio.current_task()
    assert owner is not None
    owner.uncancel()


async def _never() -> dict[str, Any]:
    await asyncio.Event().wait()
    return {}


async def test_a_deferred_watcher_notes_the_client_leaving_and_cancels_once_armed() -> None:
    hub = DisconnectHub()
    watcher = DisconnectWatcher(_never, hub=hub, deferred=True)
    hub.lost()
    await asyncio.sleep(0)  # no cancellation while deferred
    assert watcher.fired
    watcher.arm()
    await _cancelled()
    watcher.stop()


async def test_an_armed_deferred_watcher_cancels_when_the_client_leaves() -> None:
    hub = DisconnectHub()
    watcher = DisconnectWatcher(_never, hub=hub, deferred=True)
    watcher.arm()
    hub.lost()
    await _cancelled()
    assert watcher.fired
    watcher.stop()
