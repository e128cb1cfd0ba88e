"""An event loop wrapper for tests that count the loop timers code under test starts."""

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
