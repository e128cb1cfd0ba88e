"""``python -m bench.servers.relay --host H --port P --target HOST:PORT``: the cheapest hop Python can run.

The benchmark's floor for any proxy on the sidecar's core: a TCP relay with
no logic at all. Each accepted client connection gets one upstream
connection of its own to ``--target``; bytes are copied both ways in
``data_received`` callbacks of asyncio Protocols on uvloop, never parsed,
never buffered beyond the transports' own write buffers. Measuring it beside
the sidecar in the same run (``python -m bench``) says how much of the
sidecar's cost over the direct path any hop in this layout pays anyway.

Behaviour:

* Back-pressure: when a transport's write buffer passes its high-water mark
  (``pause_writing``), the relay stops reading the other side of the pair
  until the buffer drains (``resume_writing``), so a slow reader throttles
  the writer instead of growing the relay's memory.
* Closing: an end of stream, a close or a reset on either side closes the
  other (a close after flushing what is already buffered for it, a reset
  at once). Half-closed connections are not kept: HTTP/1.1 peers close, they
  do not half-close.
* A client's first bytes are held (and the client not read further) until
  its upstream connection is up; when the target refuses, the client is
  reset.
* ``SIGTERM`` (or ``SIGINT``): stop accepting, close every connection, and
  exit 0 once they are gone (at most ``STOP_TIMEOUT`` later, resetting what
  is left).

``--port 0`` binds an ephemeral port; the first line on stdout says which
(``relay listening on HOST:PORT -> TARGET``), once the socket is listening.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from collections.abc import Sequence
from typing import cast

import uvloop

STOP_TIMEOUT = 5.0
BACKLOG = 1024


class _End(asyncio.Protocol):
    """One socket of a relayed pair: what it reads goes to its peer; its full buffer pauses the peer.

    ``peer`` is the other end of the pair (set before either end connects);
    ``transport`` is ``None`` until connected and again once lost.
    """

    def __init__(self, relay: Relay) -> None:
        self._relay = relay
        self.transport: asyncio.Transport | None = None
        self.peer: _End | None = None
        self._held: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's TCP transports do not subclass it
        self._relay.opened(self)

    def data_received(self, data: bytes) -> None:
        peer = self.peer
        if peer is not None and peer.transport is not None:
            peer.transport.write(data)
            return
        # The peer is not connected yet (uvloop starts reading right after connection_made):
        # hold this, and read no more until it is.
        self._held.append(data)
        if self.transport is not None:
            self.transport.pause_reading()

    def peer_connected(self) -> None:
        """Send what was held for the peer, and read again."""
        assert self.peer is not None and self.peer.transport is not None and self.transport is not None
        for data in self._held:
            self.peer.transport.write(data)
        self._held.clear()
        self.transport.resume_reading()

    def eof_received(self) -> bool:
        return False  # close this end; connection_lost closes the peer

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self._relay.closed(self)
        peer = self.peer
        if peer is not None and peer.transport is not None:
            if exc is None:
                peer.transport.close()  # after flushing what is already buffered for it
            else:
                peer.transport.abort()

    def pause_writing(self) -> None:
        """Our write buffer is full: stop reading the peer, which is what fills it."""
        peer = self.peer
        if peer is not None and peer.transport is not None:
            peer.transport.pause_reading()

    def resume_writing(self) -> None:
        peer = self.peer
        if peer is not None and peer.transport is not None:
            peer.transport.resume_reading()


class _Client(_End):
    """The accepted end: its upstream connection is opened as it connects."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._relay.connect(self)


class Relay:
    """Accepts clients, connects each to the target, and tracks every open end for shutdown."""

    def __init__(self, target_host: str, target_port: int) -> None:
        self._target = (target_host, target_port)
        self._ends: set[_End] = set()
        self._connecting: set[asyncio.Task[None]] = set()
        self._empty = asyncio.Event()
        self._empty.set()
        self.accepted = 0

    def accept(self) -> _Client:
        """The listening socket's protocol factory."""
        self.accepted += 1
        return _Client(self)

    def opened(self, end: _End) -> None:
        self._ends.add(end)
        self._empty.clear()

    def closed(self, end: _End) -> None:
        self._ends.discard(end)
        if not self._ends:
            self._empty.set()

    def connect(self, client: _Client) -> None:
        task = asyncio.get_running_loop().create_task(self._connect(client))
        self._connecting.add(task)
        task.add_done_callback(self._connecting.discard)

    async def _connect(self, client: _Client) -> None:
        upstream = _End(self)
        upstream.peer, client.peer = client, upstream  # linked before the upstream end connects
        loop = asyncio.get_running_loop()
        try:
            await loop.create_connection(lambda: upstream, *self._target)
        except OSError:
            if client.transport is not None:
                client.transport.abort()
            return
        if client.transport is None:  # the client left while we connected
            if upstream.transport is not None:
                upstream.transport.close()
            return
        client.peer_connected()

    async def shutdown(self, grace: float) -> None:
        """Close every connection (flushing), wait up to ``grace`` seconds for them to go, reset the rest."""
        for task in list(self._connecting):
            task.cancel()
        await asyncio.gather(*self._connecting, return_exceptions=True)
        for end in list(self._ends):
            if end.transport is not None:
                end.transport.close()
        try:
            await asyncio.wait_for(self._empty.wait(), grace)
        except TimeoutError:
            for end in list(self._ends):
                if end.transport is not None:
                    end.transport.abort()


async def serve(host: str, port: int, target_host: str, target_port: int) -> None:
    """Relay until ``SIGTERM`` or ``SIGINT``, then shut down gracefully."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    relay = Relay(target_host, target_port)
    server = await loop.create_server(relay.accept, host, port, backlog=BACKLOG)
    bound = server.sockets[0].getsockname()
    print(f"relay listening on {bound[0]}:{bound[1]} -> {target_host}:{target_port}", flush=True)
    await stop.wait()
    server.close()
    await relay.shutdown(STOP_TIMEOUT)
    await server.wait_closed()
    print(f"relay stopped after {relay.accepted} connection(s)", flush=True)


def parse_target(value: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` for IPv6) into its parts."""
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise argparse.ArgumentTypeError(f"not HOST:PORT: {value!r}")
    return host.removeprefix("[").removesuffix("]"), int(port)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.servers.relay", description=__doc__.split("\n")[0])
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, required=True, help="port to listen on (0: any free port)")
    parser.add_argument("--target", type=parse_target, required=True, help="HOST:PORT to relay to")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    target_host, target_port = args.target
    try:
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            runner.run(serve(args.host, args.port, target_host, target_port))
    except OSError as exc:
        print(f"relay: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
