"""Real uvicorn servers on ephemeral loopback ports, for integration tests.

``ServerThread`` binds a socket to port 0 itself (so the port is known before
the server starts), runs ``uvicorn.Server`` on its own event loop in a thread,
and waits on ``server.started`` (polled, never slept on a fixed guess).
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn


def bind_ephemeral(host: str = "127.0.0.1") -> socket.socket:
    # IPPROTO_TCP explicitly: asyncio then sets TCP_NODELAY on accepted connections.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    sock.listen(2048)
    sock.setblocking(False)
    return sock


class ServerThread:
    """ASGI apps served by real uvicorn servers sharing one event loop in a background thread.

    The first app is the main one (``url``/``port``); further apps (``extra``)
    get their own ports (``urls``), e.g. the sidecar's admin app.
    """

    def __init__(self, app: Any, *extra: Any, **config: Any) -> None:
        self.socks = [bind_ephemeral() for _ in range(1 + len(extra))]
        self.ports: list[int] = [s.getsockname()[1] for s in self.socks]
        self.urls = [f"http://127.0.0.1:{p}" for p in self.ports]
        self.port, self.url = self.ports[0], self.urls[0]
        options = {"log_level": "warning", "lifespan": "on", "loop": "asyncio", "http": "h11"}
        options.update(config)
        self.servers = [uvicorn.Server(uvicorn.Config(app, **options))]
        self.servers += [uvicorn.Server(uvicorn.Config(a, **{**options, "lifespan": "off"})) for a in extra]
        self.server = self.servers[0]
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.loop: asyncio.AbstractEventLoop | None = None

    def _run(self) -> None:
        self.loop = asyncio.new_event_loop()

        async def main() -> None:
            await asyncio.gather(
                *(s.serve(sockets=[k]) for s, k in zip(self.servers, self.socks, strict=True))
            )

        try:
            self.loop.run_until_complete(main())
        finally:
            self.loop.close()

    def start(self, timeout: float = 60.0) -> ServerThread:  # a bound for a hang, not a measure
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not all(s.started for s in self.servers):
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("server did not start")
            time.sleep(0.005)
        return self

    def call(self, coro: Any, timeout: float = 30.0) -> Any:
        """Run a coroutine on the servers' loop and return its result."""
        assert self.loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self, timeout: float = 30.0) -> None:
        for server in self.servers:
            server.should_exit = True
        self.thread.join(timeout)
        for sock in self.socks:
            sock.close()


@contextmanager
def serve(app: Any, *extra: Any, **config: Any) -> Iterator[ServerThread]:
    """Run ``app`` (and ``extra`` apps) on ephemeral ports for the duration of the block."""
    server = ServerThread(app, *extra, **config).start()
    try:
        yield server
    finally:
        server.stop()
