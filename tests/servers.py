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
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    sock.listen(2048)
    sock.setblocking(False)
    return sock


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


class ServerThread:
    """One ASGI app served by real uvicorn in a background thread."""

    def __init__(self, app: Any, **config: Any) -> None:
        self.sock = bind_ephemeral()
        self.port: int = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        options = {"log_level": "warning", "lifespan": "on", "loop": "asyncio", "http": "h11"}
        options.update(config)
        self.server = uvicorn.Server(uvicorn.Config(app, **options))
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.loop: asyncio.AbstractEventLoop | None = None

    def _run(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.loop.run_until_complete(self.server.serve(sockets=[self.sock]))

    def start(self, timeout: float = 15.0) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("server did not start")
            time.sleep(0.005)
        return self

    def stop(self, timeout: float = 15.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)
        self.sock.close()


@contextmanager
def serve(app: Any, **config: Any) -> Iterator[ServerThread]:
    """Run ``app`` on an ephemeral port for the duration of the block."""
    server = ServerThread(app, **config).start()
    try:
        yield server
    finally:
        server.stop()
