"""A TCP fault gate: a relay on loopback that can refuse, hold, garble, reset or slow a link.

``FaultGate(upstream_port)`` listens on an ephemeral 127.0.0.1 port (fixed for
its life) and relays every connection to ``upstream_port``. ``set(mode)``
changes what happens from then on:

* ``pass``: relay both ways.
* ``down``: the port refuses connections (the listening socket is closed and
  re-bound on the same port when the mode changes back) and every open
  connection is cut with a reset: a crashed or stopped server.
* ``blackhole``: connections are accepted and nothing is ever answered; bytes
  on open relays are dropped both ways. A partition as TCP sees it once the
  kernel has accepted (emulation only: see ``docs/dev/reliability.md``).
* ``garbage``: every new connection is answered ``GARBAGE`` (not HTTP, not
  ZMTP) and closed; open relays are cut.
* ``reset``: a new connection is read once, then reset (RST, no answer).
* ``delay``: relay, holding every upstream-to-client chunk ``delay`` seconds
  (in order): a slow peer.
* ``script``: every new connection is handed to ``script(reader, writer)``, a
  hand-written peer (an HTTP head followed by a reset, for instance).

The gate runs its own event loop in a daemon thread, so it can sit in front of
servers on any loop and be switched from test code. It counts what it did
(``stats``) so a scenario can prove the fault was actually hit.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import threading
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from typing import Literal

Mode = Literal["pass", "down", "blackhole", "garbage", "reset", "delay", "script"]
Script = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
GARBAGE = b"\x00\xffNOT-HTTP \x13\x37 garbage \xde\xad\xbe\xef\r\n\r\n" * 4
_CHUNK = 65536


def _listener(port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen(1024)
    sock.setblocking(False)
    return sock


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close with a TCP reset (SO_LINGER 0), as a crashed peer's kernel does."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


class FaultGate:
    """A switchable TCP relay (see the module docstring)."""

    def __init__(self, upstream_port: int, upstream_host: str = "127.0.0.1") -> None:
        self.upstream = (upstream_host, upstream_port)
        self.mode: Mode = "pass"
        self.delay = 0.0
        self.script: Script | None = None
        self.stats: Counter[str] = Counter()
        self._sock = _listener(0)
        self.port: int = self._sock.getsockname()[1]
        self._loop = asyncio.new_event_loop()
        self._listening = False
        self._open: set[asyncio.StreamWriter] = set()
        # The gate accepts by hand and holds every accepted socket and handler task until it is
        # done with them: nothing it accepted can be collected open, or outlive stop().
        self._raw: set[socket.socket] = set()
        self._handlers: set[asyncio.Task[None]] = set()
        self._closing = False
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"fault-gate-{self.port}", daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # -- control (any thread) ------------------------------------------------------------------

    def start(self) -> FaultGate:
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("fault gate did not start")
        return self

    def set(self, mode: Mode, delay: float = 0.0, script: Script | None = None) -> None:
        """Switch the gate; returns once the switch is in effect."""
        self.script = script
        future = asyncio.run_coroutine_threadsafe(self._switch(mode, delay), self._loop)
        future.result(10)

    def stop(self) -> None:
        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(self._close(), self._loop).result(10)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)

    # -- the relay (gate thread) ----------------------------------------------------------------

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._listen())
        self._ready.set()
        try:
            self._loop.run_forever()
        finally:
            self._loop.close()

    async def _listen(self) -> None:
        if self._sock.fileno() < 0:
            self._sock = _listener(self.port)
        self._sock.setblocking(False)
        self._loop.add_reader(self._sock.fileno(), self._accept_ready, self._sock)
        self._listening = True

    def _accept_ready(self, listener: socket.socket) -> None:
        """Accept what is waiting (a plain callback: no task can be cancelled holding a socket)."""
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:  # nothing more waiting (BlockingIOError), or the listener is closed
                return
            conn.setblocking(False)
            self._raw.add(conn)
            task = self._loop.create_task(self._serve(conn))
            self._handlers.add(task)
            task.add_done_callback(self._handlers.discard)

    async def _serve(self, conn: socket.socket) -> None:
        try:
            reader, writer = await asyncio.open_connection(sock=conn)
        except OSError:
            conn.close()
            return
        finally:
            self._raw.discard(conn)
        await self._accept(reader, writer)

    async def _switch(self, mode: Mode, delay: float) -> None:
        was, self.mode, self.delay = self.mode, mode, delay
        self.stats[f"switch_{mode}"] += 1
        if mode == "down" and was != "down":
            await self._unlisten()
        if mode in ("down", "garbage", "reset"):
            self._cut_all()
        if mode != "down" and was == "down":
            await self._listen()

    async def _unlisten(self) -> None:
        if self._listening:
            self._loop.remove_reader(self._sock.fileno())
            self._listening = False
        self._sock.close()  # connections are refused now

    def _cut_all(self) -> None:
        for writer in list(self._open):
            _reset(writer)
        self._open.clear()

    async def _close(self) -> None:
        self._closing = True
        await self._unlisten()
        self._cut_all()
        # Every handler runs to its end: one accepted just now sees _closing and resets its
        # connection, the others were cut above. One still running after the bound (a script
        # that hangs) is cancelled; its finally aborts its transport.
        if self._handlers:
            _, pending = await asyncio.wait(set(self._handlers), timeout=5.0)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        for conn in list(self._raw):
            conn.close()
        self._raw.clear()
        await asyncio.sleep(0)  # let the aborted transports close their sockets

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        mode = self.mode
        self.stats[f"accepted_{mode}"] += 1
        self._open.add(writer)
        try:
            if self._closing or mode == "down":  # accepted just before the listener closed
                _reset(writer)
            elif mode == "script" and self.script is not None:
                await self.script(reader, writer)
            elif mode == "garbage":
                writer.write(GARBAGE)
                with contextlib.suppress(OSError):
                    await writer.drain()
                writer.close()
            elif mode == "reset":
                with contextlib.suppress(OSError):
                    await reader.read(_CHUNK)
                _reset(writer)
            elif mode == "blackhole":
                await self._swallow(reader)
            else:
                await self._relay(reader, writer)
        finally:
            self._open.discard(writer)
            if not writer.transport.is_closing():
                writer.transport.abort()

    async def _swallow(self, reader: asyncio.StreamReader) -> None:
        with contextlib.suppress(OSError):
            while await reader.read(_CHUNK):
                self.stats["swallowed_chunks"] += 1

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        except OSError:
            _reset(writer)
            return
        self._open.add(up_writer)
        try:
            await asyncio.gather(
                self._pipe(reader, up_writer, upstream=False),
                self._pipe(up_reader, writer, upstream=True),
            )
        finally:
            self._open.discard(up_writer)
            for side in (writer, up_writer):
                if not side.transport.is_closing():
                    side.transport.abort()

    async def _pipe(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, upstream: bool) -> None:
        try:
            while chunk := await src.read(_CHUNK):
                if self.mode == "blackhole":
                    self.stats["swallowed_chunks"] += 1
                    continue
                if upstream and self.mode == "delay" and self.delay:
                    await asyncio.sleep(self.delay)  # fault injection: the peer is slow on purpose
                    self.stats["delayed_chunks"] += 1
                dst.write(chunk)
                await dst.drain()
        except OSError:
            pass
        finally:
            if not dst.transport.is_closing():
                with contextlib.suppress(OSError):
                    dst.write_eof()


@contextlib.contextmanager
def fault_gate(upstream_port: int) -> Iterator[FaultGate]:
    """A started ``FaultGate`` for the duration of the block."""
    gate = FaultGate(upstream_port).start()
    try:
        yield gate
    finally:
        gate.stop()
