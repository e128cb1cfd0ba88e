"""ASGI apps served by real uvicorn servers on ephemeral loopback ports, in a background thread.

The demo's cluster runs on it, and so do the tests: ``ServerThread`` binds each app's socket to
port 0 itself (the port is known before the server starts, and nothing can take it between), runs
one ``uvicorn.Server`` per app on one event loop in a thread, and returns from ``start`` once every
server has started (polled, never slept on a guess); a server that cannot start fails ``start``
with its exception. ``stop`` asks every server to exit, so each lifespan closes what it opened.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import uvicorn

T = TypeVar("T")
START_TIMEOUT = 60.0  # a bound for a hang, not a measure


def bind_ephemeral(host: str = "127.0.0.1") -> socket.socket:
    """A listening socket on a port the kernel picks, for uvicorn to serve on."""
    # IPPROTO_TCP explicitly: asyncio then sets TCP_NODELAY on accepted connections.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    sock.listen(2048)
    sock.setblocking(False)
    return sock


class ServerThread:
    """``app`` and the ``extra`` apps, each on its own port, served on one event loop in a thread.

    The first app is the main one (``url``, ``port``) and runs its lifespan; the ``extra`` apps
    (e.g. the sidecar's admin app) get their own ports (``urls``) and no lifespan of their own.
    ``config`` goes to every ``uvicorn.Config`` (default: h11, warnings only); ``loop_factory`` makes the
    thread's event loop (default: asyncio's).
    """

    def __init__(
        self,
        app: Any,
        *extra: Any,
        loop_factory: Callable[[], asyncio.AbstractEventLoop] = asyncio.new_event_loop,
        **config: Any,
    ) -> None:
        self.socks = [bind_ephemeral() for _ in range(1 + len(extra))]
        self.ports: list[int] = [s.getsockname()[1] for s in self.socks]
        self.urls = [f"http://127.0.0.1:{p}" for p in self.ports]
        self.port, self.url = self.ports[0], self.urls[0]
        options = {"log_level": "warning", "lifespan": "on", "loop": "asyncio", "http": "h11", **config}
        self.servers = [uvicorn.Server(uvicorn.Config(app, **options))]
        self.servers += [uvicorn.Server(uvicorn.Config(a, **{**options, "lifespan": "off"})) for a in extra]
        self.server = self.servers[0]
        self.thread = threading.Thread(target=self._run, name="servers", daemon=True)
        self.loop: asyncio.AbstractEventLoop | None = None
        self._new_loop = loop_factory
        self._failed: BaseException | None = None

    def _run(self) -> None:
        self.loop = self._new_loop()

        async def main() -> None:
            await asyncio.gather(
                *(s.serve(sockets=[k]) for s, k in zip(self.servers, self.socks, strict=True))
            )

        try:
            self.loop.run_until_complete(main())
        except BaseException as exc:  # reported by start()
            self._failed = exc
        finally:
            self.loop.close()

    def start(self, timeout: float = START_TIMEOUT) -> ServerThread:
        """Serve every app; return once all have started (raise if one could not)."""
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not all(s.started for s in self.servers):
            if not self.thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"a server did not start: {self._failed or 'see the log above'}")
            time.sleep(0.005)
        return self

    def call(self, coro: Coroutine[Any, Any, T], timeout: float = 30.0) -> T:
        """Run a coroutine on the servers' loop and return its result."""
        assert self.loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self, timeout: float = 30.0) -> None:
        """Ask every server to exit (their lifespans close what they opened) and wait."""
        for server in self.servers:
            server.should_exit = True
        if self.thread.is_alive():
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
