"""The sidecar's one bounded map with expiry, on ``cachetools.TTLCache``.

Every table the sidecar keeps per release or per P engine is one of these:
the de-duplication ledger, the NIXL strategy's per-job progress and handshake
cache, and the ``auto`` strategy's pinned jobs (the parameters D may be
reading, written on every request, keep a plain dict of deadlines:
``sidecar.decision.judge.InFlight``). Each is bounded (the least recently set
entry goes first when full) and forgets entries after their time to live. Entries the map drops by
itself (expired or evicted) can be collected with ``take_dropped`` by an owner
that must clean up after them (the handshake cache removes their NIXL agents);
others leave ``keep_dropped`` off.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from cachetools import TTLCache

K = TypeVar("K")
V = TypeVar("V")


class TTLMap(TTLCache[K, V], Generic[K, V]):
    """A bounded map whose entries expire ``ttl`` seconds after they were set."""

    def __init__(
        self,
        maxsize: int,
        ttl: float,
        clock: Callable[[], float] = time.monotonic,
        keep_dropped: bool = False,
    ) -> None:
        super().__init__(maxsize, ttl, timer=clock)
        self._keep = keep_dropped
        self._dropped: list[tuple[K, V]] = []

    def popitem(self) -> tuple[K, V]:
        item = super().popitem()
        if self._keep:
            self._dropped.append(item)
        return item

    def expire(self, time: Any = None) -> list[tuple[K, V]]:
        items = list(super().expire(time))
        if self._keep:
            self._dropped.extend(items)
        return items

    def take_dropped(self) -> list[tuple[K, V]]:
        """The entries dropped by expiry or eviction since the last call."""
        dropped, self._dropped = self._dropped, []
        return dropped
