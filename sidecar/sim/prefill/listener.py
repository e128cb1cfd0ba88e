"""P's NIXL side channel: ZMQ ROUTER listeners, each served by its own thread.

Up to 0.11.0 every worker listens on ``base + tp_rank``; from 0.11.1 one
scheduler listener on ``base`` serves all ranks (vLLM 0.11.1+). A thread
answers ``identity, b"", payload[, timestamp]``; any exception while handling a
request ends it and closes its socket, as in vLLM, where the listener loop
only survives its receive timeout: a malformed handshake leaves P without a
side channel, and ``alive`` turns false. The simulator polls with a short
timeout instead of vLLM's 1 s (or none before 0.11.1) so that shutdown is
quick; that is not visible on the wire.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import zmq

from sidecar.sim.prefill.release import Release
from sidecar.sim.prefill.wire import HandshakeKey, handshake_payload, timestamp_frame

logger = logging.getLogger("sidecar.sim.prefill")

_POLL_MS = 50
_BIND_ATTEMPTS = 50


def zmq_address(host: str, port: int) -> str:
    """``tcp://host:port`` (IPv6 hosts in brackets)."""
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def _router(ctx: zmq.Context[zmq.Socket[bytes]], host: str) -> zmq.Socket[bytes]:
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    if ":" in host:
        sock.setsockopt(zmq.IPV6, 1)
    return sock


def bind_listeners(
    ctx: zmq.Context[zmq.Socket[bytes]], host: str, base_port: int, count: int
) -> tuple[int, list[zmq.Socket[bytes]]]:
    """Bind ``count`` ROUTER sockets on consecutive ports from ``base_port``.

    ``base_port`` 0 picks a free base (retrying until the whole run is free).
    Returns the base port and the sockets; raises ``zmq.ZMQError`` if taken.
    """
    for _ in range(_BIND_ATTEMPTS if base_port == 0 else 1):
        socks: list[zmq.Socket[bytes]] = []
        try:
            first = _router(ctx, host)
            socks.append(first)
            if base_port == 0:
                base = first.bind_to_random_port(zmq_address(host, 0).rsplit(":", 1)[0])
            else:
                base = base_port
                first.bind(zmq_address(host, base))
            for offset in range(1, count):
                sock = _router(ctx, host)
                socks.append(sock)
                sock.bind(zmq_address(host, base + offset))
            return base, socks
        except zmq.ZMQError:
            for sock in socks:
                sock.close(linger=0)
            if base_port != 0:
                raise
    raise zmq.ZMQError(zmq.EADDRINUSE, f"no run of {count} free ports on {host}")


class ListenerThread:
    """One ROUTER socket answering handshakes until stopped or killed."""

    def __init__(
        self,
        sock: zmq.Socket[bytes],
        release: Release,
        table: Callable[[], Mapping[Any, bytes]],
        own_key: HandshakeKey,
        on_served: Callable[[], None],
    ) -> None:
        self._sock, self._release, self._table = sock, release, table
        self._own_key, self._on_served = own_key, on_served
        self._stop = threading.Event()
        self.error: str | None = None
        self._thread = threading.Thread(target=self._run, name="sim-prefill-listener", daemon=True)

    @property
    def alive(self) -> bool:
        """False once a malformed request killed the thread (or after stop)."""
        return self._thread.is_alive()

    def start(self) -> None:
        """Start answering handshakes."""
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the thread; it closes its socket on the way out."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        else:
            self._sock.close(linger=0)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                if self._sock.poll(_POLL_MS, zmq.POLLIN):
                    self._answer_one()
        except Exception as exc:  # vLLM's listener dies here; so does ours
            self.error = f"{type(exc).__name__}: {exc}"
            logger.error("NIXL handshake listener died: %s (P has no side channel now)", self.error)
        finally:
            self._sock.close(linger=0)

    def _answer_one(self) -> None:
        identity, _, msg = self._sock.recv_multipart(zmq.NOBLOCK)
        payload = handshake_payload(self._release, self._table(), msg, self._own_key)
        frames = [identity, b"", payload]
        if self._release.reply_timestamp:
            frames.append(timestamp_frame(time.perf_counter()))
        self._sock.send_multipart(frames)
        self._on_served()
