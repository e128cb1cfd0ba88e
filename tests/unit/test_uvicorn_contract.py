"""What the sidecar relies on of uvicorn's public surface, checked against the installed release.

``sidecar.server.host`` runs the sidecar's own HTTP/1.1 protocol in uvicorn's
``Server`` (``tests/unit/test_uvicorn_public.py`` keeps it to ``uvicorn.Config``
and ``uvicorn.Server``). These tests say what a uvicorn release changed of what
the sidecar does with them: a protocol class given as ``Config(http=...)`` is
made per connection and serves; ``Server.serve`` enters ``capture_signals``,
awaits ``startup(sockets=...)`` (which the sidecar replaces), and on exit asks
every connection in ``server_state.connections`` to ``shutdown()``, waits for
them and for ``server_state.tasks`` up to ``timeout_graceful_shutdown``,
cancels what is left, then runs the lifespan's shutdown. ``make deps-release``
runs them on a new uvicorn with the rest of the suite.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Generator
from typing import Any

import httpx
import uvicorn

from sidecar.server.host import Server, serve_tls, server_options, uvicorn_config
from sidecar.server.limits import ServerLimits
from sidecar.server.protocol import GuardedProtocol
from tests.support.until import until_async


async def _ok(scope: Any, receive: Any, send: Any) -> None:
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        events.append("lifespan shutdown")
        await send({"type": "lifespan.shutdown.complete"})
        return
    await receive()
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


events: list[str] = []


def _listening() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    return sock


async def test_uvicorns_own_server_makes_the_protocol_class_per_connection_and_it_serves() -> None:
    config = uvicorn.Config(_ok, lifespan="off", log_config=None, **server_options(ServerLimits()))
    server = uvicorn.Server(config)
    sock = _listening()
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        await until_async(lambda: server.started, "the server to start")
        assert config.http_protocol_class is config.http and issubclass(config.http, GuardedProtocol)
        url = f"http://127.0.0.1:{sock.getsockname()[1]}/"
        async with httpx.AsyncClient() as client:
            assert (await client.get(url)).text == "ok"
            assert server.server_state.total_requests == 1
            assert [type(c) for c in server.server_state.connections] == [config.http]
    finally:
        server.should_exit = True
        await task
        sock.close()


class Recorded(Server):
    """The sidecar's server, noting what uvicorn's ``serve`` calls."""

    calls: list[str]

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        self.calls.append("capture_signals")
        yield

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self.calls.append(f"startup({len(sockets or [])} sockets)")
        await super().startup(sockets=sockets)
        # what the sidecar's startup reads and sets
        self.calls.append(f"started={self.started} servers={len(self.servers)}")


class Connection:
    """A connection as uvicorn's shutdown sees it."""

    def __init__(self, state: Any) -> None:
        self.state = state
        state.connections.add(self)
        self.asked = False

    def shutdown(self) -> None:
        self.asked = True
        self.state.connections.discard(self)


async def test_serve_starts_through_startup_and_shuts_down_connections_tasks_and_lifespan() -> None:
    events.clear()
    config = uvicorn_config(_ok, "127.0.0.1", 0, ServerLimits(), lifespan="on", timeout_graceful_shutdown=0.5)
    server = Recorded(config)
    server.calls = []
    sock = _listening()
    task = asyncio.create_task(server.serve(sockets=[sock]))
    await until_async(lambda: server.started, "the server to start")
    assert server.calls == ["capture_signals", "startup(1 sockets)", "started=True servers=1"]
    assert server.lifespan.state == {} and not server.lifespan.should_exit
    connection = Connection(server.server_state)
    finishes, hangs = asyncio.Event(), asyncio.Event()
    done = asyncio.create_task(finishes.wait())
    stuck = asyncio.create_task(hangs.wait())
    server.server_state.tasks.update({done, stuck})
    asyncio.get_running_loop().call_later(0.2, finishes.set)
    server.should_exit = True
    await task
    sock.close()
    assert connection.asked  # every connection was asked to close
    assert done.done() and not done.cancelled()  # a request that ends in time is waited for
    assert stuck.cancelled()  # one past timeout_graceful_shutdown is cancelled
    assert events == ["lifespan shutdown"]


async def test_a_failed_lifespan_stops_the_server_without_ending_the_process() -> None:
    async def failing(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        await send({"type": "lifespan.startup.failed", "message": "no"})

    server = Server(uvicorn_config(failing, "127.0.0.1", 0, ServerLimits(), lifespan="on"))
    sock = _listening()
    await asyncio.wait_for(server.serve(sockets=[sock]), 10)  # uvicorn's own would sys.exit
    sock.close()
    assert server.startup_failed and not server.started


def test_the_config_takes_a_tls_context_once_loaded() -> None:
    import ssl

    config = uvicorn_config(_ok, "127.0.0.1", 0, ServerLimits())
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    tls: Any = type("TLS", (), {"context": context})()
    serve_tls(config, tls)
    assert config.loaded and config.ssl is context
    assert issubclass(config.http_protocol_class, GuardedProtocol)  # type: ignore[arg-type]
