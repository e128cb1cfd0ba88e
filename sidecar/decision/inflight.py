"""The in-flight veto: parameters D may still be reading are never released.

``InFlight`` refuses to release parameters that another request through this
sidecar forwarded to D and that D may be reading (in flight, or admitted
within the lease): a replayed, failing copy of a live request never frees its
blocks. The judge asks it before every release.

Every admitted request is remembered, so that table is written once per
request: a plain dict of deadlines in the order they were set (every entry
lives for the same ``ttl``, so that is also the order they expire in), which
costs a fraction of a general map with expiry.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable


class InFlight:
    """Keys of parameters forwarded to D that D may still read: in flight, or admitted recently."""

    def __init__(self, size: int, ttl: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._live: dict[Hashable, int] = {}
        # Key -> the clock's time it stops being read, oldest first; at most ``size`` of them.
        self._admitted: dict[Hashable, float] = {}
        self._size, self._ttl, self._clock = size, ttl, clock

    def forwarded(self, key: Hashable) -> None:
        self._live[key] = self._live.get(key, 0) + 1

    def finished(self, key: Hashable, admitted: bool) -> None:
        count = self._live.get(key, 0) - 1
        if count > 0:
            self._live[key] = count
        else:
            self._live.pop(key, None)
        if admitted:
            self.admitted(key)

    def admitted(self, key: Hashable) -> None:
        """D may read these parameters for the next ``ttl`` seconds (it admitted, or is aborting, one)."""
        admitted, now = self._admitted, self._clock()
        admitted.pop(key, None)  # set again: now the newest
        admitted[key] = now + self._ttl
        # The oldest entry goes once expired or over the size: one per call, so the expired
        # drain as new ones come, and the table never holds more than ``size``.
        oldest = next(iter(admitted))
        if admitted[oldest] <= now or len(admitted) > self._size:
            del admitted[oldest]

    def may_be_read(self, key: Hashable) -> bool:
        """Another request with these parameters is at D, or D admitted one within the lease."""
        if self._live.get(key, 0) > 0:
            return True
        until = self._admitted.get(key)
        return until is not None and self._clock() < until
