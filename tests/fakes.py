"""Fakes for tests that drive a protocol by hand: its transport, and a loop counting timers."""

from __future__ import annotations

import asyncio
from typing import Any


class CountingLoop:
    """The running loop, counting ``call_later`` and ``call_at``; everything else passes through."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.timers = 0

    def call_later(self, delay: float, callback: Any, *args: Any) -> asyncio.TimerHandle:
        self.timers += 1
        return self._loop.call_later(delay, callback, *args)

    def call_at(self, when: float, callback: Any, *args: Any) -> asyncio.TimerHandle:
        self.timers += 1
        return self._loop.call_at(when, callback, *args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loop, name)


class FakeTransport:
    """The transport calls uvicorn's protocol makes, recorded."""

    def __init__(self) -> None:
        self.written = bytearray()
        self.writes: list[bytes] = []  # one entry per write call: what a socket write would send
        self.closing = False
        self.closed = asyncio.Event()
        self.reading = True
        self.protocol: Any = None

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"sockname": ("127.0.0.1", 8000), "peername": ("127.0.0.1", 50000)}.get(name, default)

    def get_protocol(self) -> Any:
        return self.protocol

    def write(self, data: bytes) -> None:
        self.written += data
        self.writes.append(bytes(data))

    def writelines(self, data: list[bytes]) -> None:
        self.write(b"".join(data))

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        self.closing = True
        self.closed.set()

    def abort(self) -> None:
        self.closing = True

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True
