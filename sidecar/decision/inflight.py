"""The in-flight veto: parameters D may still be reading are never released.

``InFlight`` refuses to release parameters that another request through this
sidecar forwarded to D and that D may be reading (in flight, or admitted
within the lease): a replayed, failing copy of a live request never frees its
blocks. The judge asks it before every release.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable

from sidecar.ttlmap import TTLMap


class InFlight:
    """Keys of parameters forwarded to D that D may still read: in flight, or admitted recently."""

    def __init__(self, size: int, ttl: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._live: dict[Hashable, int] = {}
        self._admitted: TTLMap[Hashable, bool] = TTLMap(size, ttl, clock)

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
        self._admitted[key] = True

    def may_be_read(self, key: Hashable) -> bool:
        """Another request with these parameters is at D, or D admitted one within the lease."""
        return self._live.get(key, 0) > 0 or key in self._admitted
