"""Accepting connections: every one waiting in the kernel's queue each time a listener is readable.

The libuv that uvloop 0.23 bundles accepts a single connection each time a listening socket is
reported readable (``uv__server_io`` in ``src/unix/stream.c``; older libuv looped until
``EAGAIN``). An event loop busy with thousands of streams runs an iteration in tens of
milliseconds, so its own server (``loop.create_server``) took new connections at tens a second
and a burst of them (a router restarting, a rollout) waited seconds in the kernel. ``Acceptor``
reads the listening socket itself and hands each connection to the loop as an accepted socket
(``loop.connect_accepted_socket``, TLS included), as nginx's ``multi_accept`` does.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import socket
from collections.abc import Callable
from typing import Any

log = logging.getLogger("sidecar.serve")

# Accept errors that mean "out of a resource for now": stop accepting for a while, as asyncio does
# (its ACCEPT_RETRY_DELAY), rather than spin on a socket that stays readable.
_SHORT_OF = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
ACCEPT_RETRY_DELAY = 1.0


class Acceptor:
    """Serves one listening socket: each time it is readable, every connection waiting in the
    kernel's queue (up to ``batch``) is accepted and handed to the loop as an accepted socket.

    The event loop's own server (``loop.create_server``) is not used: uvloop 0.23's libuv takes
    one connection per readiness (``uv__server_io``), so a busy loop accepted one connection per
    iteration. The listening socket stays level-triggered, so more than ``batch`` waiting are
    taken on the next iteration. Quacks as an ``asyncio.Server`` for uvicorn's ``shutdown``
    (``close``, ``wait_closed``); the socket itself is closed by its owner.
    """

    batch = 1024

    def __init__(
        self,
        sock: socket.socket,
        factory: Callable[[], asyncio.Protocol],
        ssl: Any = None,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        self._loop = loop or asyncio.get_running_loop()
        self._sock, self._factory, self._ssl = sock, factory, ssl
        self._tcp = sock.family in (socket.AF_INET, socket.AF_INET6)
        self._starting: set[asyncio.Task[Any]] = set()
        self._reading = self._closed = False
        self.accepted = 0  # connections taken off the queue (tests and the accept probe read it)
        sock.setblocking(False)
        self._read()

    def _read(self) -> None:
        if not self._closed and not self._reading:
            self._loop.add_reader(self._sock.fileno(), self._ready)
            self._reading = True

    def _pause(self) -> None:
        if self._reading:
            self._loop.remove_reader(self._sock.fileno())
            self._reading = False

    def _ready(self) -> None:
        for _ in range(self.batch):
            try:
                conn, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except ConnectionAbortedError:
                continue  # the client left while queued
            except OSError as exc:
                if exc.errno in _SHORT_OF:
                    log.error(
                        "cannot accept connections, retrying in a second",
                        extra={"detail": exc.strerror or str(exc)},
                    )
                    self._pause()
                    self._loop.call_later(ACCEPT_RETRY_DELAY, self._read)
                    return
                raise
            self.accepted += 1
            self._start(conn)

    def _start(self, conn: socket.socket) -> None:
        conn.setblocking(False)
        if self._tcp:
            with contextlib.suppress(OSError):  # as the loop's own server does for its connections
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        task = self._loop.create_task(self._loop.connect_accepted_socket(self._factory, conn, ssl=self._ssl))
        self._starting.add(task)
        task.add_done_callback(self._started)

    def _started(self, task: asyncio.Task[Any]) -> None:
        self._starting.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            # A TLS handshake that failed or timed out, or a client gone before its transport
            # existed: the connection is closed by the loop; nothing was served on it.
            log.debug("connection not started", extra={"detail": repr(exc)})

    def close(self) -> None:
        """Stop accepting (connections already accepted carry on)."""
        self._pause()
        self._closed = True

    async def wait_closed(self) -> None:
        return None
