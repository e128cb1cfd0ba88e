"""The client's clock on one connection: which phase it is in, since when, and whether it ran out.

Each connection is in one phase at a time, with its own clock: ``head`` from the
connection's opening, or from the first byte after a response, until its
header block is complete (``header_timeout``); ``body`` from then until the
body is complete, measuring the gap since the latest read (``body_timeout``;
the server restarts it whenever the wait was its own); ``idle`` once the
answer is out and nothing else is due (``keep_alive``); none while the
application answers. One timer per connection serves them all: a phase only
notes when its clock started, and the timer, when it fires, checks the phase
then in force and either reports it overdue or sleeps again for what is left.
So a busy keep-alive connection touches the event loop's timers about once per
timeout, not several times per request.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Literal

from sidecar.server.limits import ServerLimits
from sidecar.transport.timers import LazyTimer

Phase = Literal["head", "body", "idle"]


class ClientClock:
    """One connection's phase and its limit; ``overdue`` is called when its limit may have passed."""

    __slots__ = ("_limits", "_loop", "_overdue", "_timer", "head_bytes", "phase", "since")

    def __init__(
        self, loop: asyncio.AbstractEventLoop, limits: ServerLimits, overdue: Callable[[Phase], None]
    ) -> None:
        self._loop, self._limits, self._overdue = loop, limits, overdue
        self._timer = LazyTimer(loop, self._fired)
        self.phase: Phase | None = None
        self.since = 0.0  # loop time the phase's clock started (the body's: the latest body bytes)
        self.head_bytes = 0  # bytes of the current header block seen so far

    def start_head(self) -> None:
        self.head_bytes = 0
        self.enter("head")

    def enter(self, phase: Phase) -> None:
        """Start ``phase``'s clock; the timer is moved only if it would fire after its limit."""
        now = self._loop.time()
        self.phase, self.since = phase, now
        self._timer.ensure(now + self.limit(phase))

    def touch(self) -> None:
        """The client just did its part (body bytes arrived, or the server lets it send again)."""
        self.since = self._loop.time()

    def answering(self) -> None:
        """The application answers: no clock runs on the client."""
        self.phase = None

    def stop(self) -> None:
        self.phase = None
        self._timer.stop()

    def limit(self, phase: Phase | None) -> float:
        """``phase``'s limit in seconds (0: none)."""
        limits = self._limits
        if phase == "head":
            return limits.header_timeout
        if phase == "body":
            return limits.body_timeout
        return limits.keep_alive if phase == "idle" else 0.0

    def _fired(self) -> None:
        phase = self.phase
        limit = self.limit(phase)
        if phase is None or not limit:
            return  # the application is answering: the next phase arms the timer again
        deadline = self.since + limit
        if self._loop.time() < deadline:
            self._timer.ensure(deadline)  # the phase began after the timer was set: sleep on
        else:
            self._overdue(phase)
