"""A busy sidecar accepts every waiting connection at once, not one per event-loop iteration.

Real servers on loopback: ``Server`` (the sidecar's uvicorn server, whose listening sockets are
read by ``Acceptor``) with clients that connected while the loop ran none of its callbacks, so
they all wait in the kernel's accept queue. What is counted is loop iterations, not time: the
loop spins a busy callback every iteration, as thousands of streams' callbacks would.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
import time
from collections.abc import Callable, Coroutine
from typing import Any

import pytest
import uvicorn
import uvloop

from sidecar.server.accept import Acceptor
from sidecar.server.host import Server, uvicorn_config
from sidecar.server.limits import ServerLimits

WAITING = 300


async def _app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    assert scope["type"] == "http"
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


def _run(factory: Callable[[], asyncio.AbstractEventLoop], coro: Coroutine[Any, Any, Any]) -> Any:
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(coro)


class Busy:
    """A callback run once per loop iteration that spends CPU each time, counting iterations."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop, self.iterations, self.stopped = loop, 0, False

    def __call__(self) -> None:
        self.iterations += 1
        end = time.perf_counter() + 0.0005
        while time.perf_counter() < end:
            pass
        if not self.stopped:
            self.loop.call_soon(self)


async def _iterations_to_accept(server: uvicorn.Server, tls: ssl.SSLContext | None = None) -> int:
    """Loop iterations ``server`` takes to open ``WAITING`` connections queued at once; each is
    then asked a request and must answer it."""
    sock = socket.create_server(("127.0.0.1", 0), backlog=4096)
    address = sock.getsockname()
    task = asyncio.create_task(server.serve(sockets=[sock]))
    loop = asyncio.get_running_loop()
    clients: list[socket.socket] = []
    try:
        while not server.started:  # polled
            assert not task.done()
            await asyncio.sleep(0.01)
        # Connected from the loop's own thread: the loop runs nothing until the last one is queued.
        clients = [socket.create_connection(address) for _ in range(WAITING)]
        busy = Busy(loop)
        loop.call_soon(busy)
        while len(server.server_state.connections) < WAITING:
            assert busy.iterations < 10 * WAITING, "the waiting connections were never all accepted"
            await asyncio.sleep(0)
        taken = busy.iterations
        busy.stopped = True
        if tls is None:
            await asyncio.gather(*(_ask(loop, c) for c in clients))
        return taken
    finally:
        for client in clients:
            client.close()
        server.should_exit = True
        await task
        sock.close()


async def _ask(loop: asyncio.AbstractEventLoop, client: socket.socket) -> None:
    client.setblocking(False)
    await loop.sock_sendall(client, b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
    answer = b""
    while not answer.endswith(b"ok"):
        chunk = await loop.sock_recv(client, 4096)
        assert chunk, f"closed after {answer!r}"
        answer += chunk
    assert answer.startswith(b"HTTP/1.1 200 ")


def _config() -> uvicorn.Config:
    return uvicorn_config(_app, "127.0.0.1", 0, ServerLimits(), lifespan="off")


LOOPS = [uvloop.new_event_loop, asyncio.new_event_loop]


@pytest.mark.parametrize("factory", LOOPS, ids=["uvloop", "asyncio"])
def test_every_waiting_connection_is_accepted_within_a_few_iterations(
    factory: Callable[[], asyncio.AbstractEventLoop],
) -> None:
    # One iteration accepts them all, the next runs their start-up tasks, the next their
    # connection_made: a handful, whatever the number waiting.
    assert _run(factory, _iterations_to_accept(Server(_config()))) <= 5


def test_uvloop_own_server_accepts_one_connection_per_iteration() -> None:
    """Why ``Acceptor`` exists: the same clients through uvicorn's own server (the loop's
    ``create_server``) on uvloop take about one iteration each. When this fails, the bundled
    libuv accepts in a loop again and ``Acceptor`` could go."""
    taken = _run(uvloop.new_event_loop, _iterations_to_accept(uvicorn.Server(_config())))
    assert taken >= WAITING * 0.9


def test_tls_connections_are_accepted_and_served(tmp_path: Any) -> None:
    trustme = pytest.importorskip("trustme")
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    cert.configure_cert(server_ctx)
    client_ctx = ssl.create_default_context()
    ca.configure_trust(client_ctx)

    async def scenario() -> bytes:
        config = _config()
        config.load()
        config.ssl = server_ctx
        server = Server(config)
        sock = socket.create_server(("127.0.0.1", 0))
        task = asyncio.create_task(server.serve(sockets=[sock]))
        try:
            while not server.started:  # polled
                assert not task.done()
                await asyncio.sleep(0.01)
            host, port = sock.getsockname()
            reader, writer = await asyncio.open_connection(host, port, ssl=client_ctx)
            writer.write(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
            answer = await reader.readuntil(b"ok")
            writer.close()
            return answer
        finally:
            server.should_exit = True
            await task
            sock.close()

    assert _run(uvloop.new_event_loop, scenario()).startswith(b"HTTP/1.1 200 ")


def test_short_of_file_descriptors_pauses_accepting_then_resumes() -> None:
    """EMFILE on accept: stop reading the socket (no spin on a listener that stays readable), try
    again a second later, and then accept the connection that waited."""

    class Full(socket.socket):
        calls = 0

        def accept(self) -> tuple[socket.socket, Any]:
            Full.calls += 1
            if Full.calls == 1:
                raise OSError(24, "Too many open files")
            return super().accept()

    async def scenario() -> int:
        plain = socket.create_server(("127.0.0.1", 0))
        sock = Full(plain.family, plain.type, fileno=plain.detach())
        opened = asyncio.Event()

        def factory() -> asyncio.Protocol:
            opened.set()
            return asyncio.Protocol()

        acceptor = Acceptor(sock, factory)
        client = socket.create_connection(sock.getsockname())
        try:
            await asyncio.wait_for(opened.wait(), 30)  # refused once, retried after the delay
            return acceptor.accepted
        finally:
            acceptor.close()
            client.close()
            sock.close()

    assert _run(uvloop.new_event_loop, scenario()) == 1
    assert Full.calls <= 3  # the refusal, the connection, the queue found empty: no spin meanwhile
