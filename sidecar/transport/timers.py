"""One event-loop timer for a connection's successive deadlines.

Every request on a keep-alive connection has deadlines (a client's header
block and body, its keep-alive, D's response headers). A loop timer started
and cancelled for each costs a libuv timer, a handle and a close callback,
several times per request. ``LazyTimer`` keeps one: a new deadline moves it
only if it falls before the time the timer is set for; otherwise the timer
fires early, and its owner, seeing the deadline then in force, acts or sets
the timer again for what is left. A busy connection so starts about one timer
per timeout instead of several per request.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable


class LazyTimer:
    """Calls ``fired`` at or before the earliest deadline ``ensure`` was given since it last fired."""

    __slots__ = ("_at", "_fired", "_handle", "_loop")

    def __init__(self, loop: asyncio.AbstractEventLoop, fired: Callable[[], None]) -> None:
        self._loop = loop
        self._fired = fired
        self._handle: asyncio.TimerHandle | None = None
        self._at = 0.0

    def ensure(self, deadline: float) -> None:
        """Fire no later than ``deadline`` (loop time)."""
        if self._handle is None or self._at > deadline:
            if self._handle is not None:
                self._handle.cancel()
            self._handle = self._loop.call_at(deadline, self._fire)
            self._at = deadline

    @property
    def armed(self) -> bool:
        return self._handle is not None

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _fire(self) -> None:
        self._handle = None
        self._fired()


class WaitTimer:
    """Awaits futures one at a time, each failing with ``TimeoutError`` past its own limit,
    on one ``LazyTimer``: a plain loop timer rather than ``asyncio.timeout`` (the cheaper of
    the two), started about once per timeout rather than once per wait."""

    __slots__ = ("_loop", "_timer", "_until", "_waiting")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._timer = LazyTimer(loop, self._fired)
        self._waiting: asyncio.Future[None] | None = None
        self._until = 0.0

    async def wait(self, waiter: asyncio.Future[None], within: float) -> None:
        """Await ``waiter``; it fails with ``TimeoutError`` if not done within ``within`` seconds."""
        self._waiting, self._until = waiter, self._loop.time() + within
        self._timer.ensure(self._until)
        try:
            await waiter
        finally:
            self._waiting = None

    def stop(self) -> None:
        self._timer.stop()

    def _fired(self) -> None:
        waiter = self._waiting
        if waiter is None or waiter.done():
            return  # no wait now: the next one starts the timer again
        if self._loop.time() < self._until:
            self._timer.ensure(self._until)  # a later wait than the one the timer was set for
        else:
            waiter.set_exception(TimeoutError())
