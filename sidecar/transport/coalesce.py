"""A response head and the body right behind it leave in one socket write.

uvicorn writes a response's status line and headers as soon as the
application sends ``http.response.start``, and the body on the next
``http.response.body``: two writes (two system calls, and on loopback two
runs of the receiver's TCP input) for an answer the proxy already holds
whole. ``CoalescingTransport`` sits between uvicorn's protocol and the
connection's transport. Told that a response may begin (``hold_next``), it
keeps the next write back: the write after it goes out together with it, and
if none comes in the same loop iteration the kept bytes leave on their own at
the end of it. So a streamed response's head is not delayed past the loop
iteration that produced it, and every other write passes straight through,
in order.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

_JOIN_LIMIT = 64 * 1024  # a body up to this size is copied behind the head; a larger one is not


class CoalescingTransport(asyncio.Transport):
    """The connection's transport, with one write held back on request (``hold_next``)."""

    __slots__ = ("_held", "_hold", "_loop", "_transport")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__()
        self._transport = transport
        self._loop = loop
        self._held: bytes | None = None
        self._hold = False

    def hold_next(self) -> None:
        """Keep the next non-empty write until the write after it, or the end of this loop iteration."""
        self._hold = True

    def direct(self) -> asyncio.Transport | None:
        """The connection's own transport, when nothing is held back: writes straight to it keep
        their order until the next write through this one (``sidecar.transport.relay`` writes many)."""
        return self._transport if self._held is None else None

    def write_whole(self, data: bytes) -> None:
        """A whole response at once: nothing is held for it (``hold_next`` is undone)."""
        self._hold = False
        self._flush()
        self._transport.write(data)

    def write(self, data: bytes | bytearray | memoryview) -> None:
        held = self._held
        if held is not None:
            self._held = None
            if len(data) <= _JOIN_LIMIT:
                self._transport.write(held + data)
            else:  # no copy of a large body
                self._transport.writelines((held, data))
        elif not data:
            return
        elif self._hold:
            self._hold = False
            self._held = bytes(data)
            self._loop.call_soon(self._flush)
        else:
            self._transport.write(data)

    def writelines(self, list_of_data: Iterable[bytes | bytearray | memoryview]) -> None:
        self._flush()
        self._transport.writelines(list_of_data)

    def _flush(self) -> None:
        held, self._held = self._held, None
        if held is not None and not self._transport.is_closing():
            self._transport.write(held)

    def close(self) -> None:
        self._flush()
        self._transport.close()

    def abort(self) -> None:
        self._held = None
        self._transport.abort()

    def write_eof(self) -> None:
        self._flush()
        self._transport.write_eof()

    def can_write_eof(self) -> bool:
        return self._transport.can_write_eof()

    def is_closing(self) -> bool:
        return self._transport.is_closing()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self._transport.get_extra_info(name, default)

    def get_protocol(self) -> asyncio.BaseProtocol:
        return self._transport.get_protocol()

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self._transport.set_protocol(protocol)

    def is_reading(self) -> bool:
        return self._transport.is_reading()

    def pause_reading(self) -> None:
        self._transport.pause_reading()

    def resume_reading(self) -> None:
        self._transport.resume_reading()

    def get_write_buffer_size(self) -> int:
        return self._transport.get_write_buffer_size() + len(self._held or b"")

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return self._transport.get_write_buffer_limits()

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        self._transport.set_write_buffer_limits(high, low)
