"""A bounded TTL set of release keys, so a client's retries never release twice."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Hashable


class Ledger:
    """Insertion-ordered keys with an expiry; the oldest go first when full."""

    def __init__(self, size: int, ttl: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._size, self._ttl, self._clock = size, ttl, clock
        self._entries: OrderedDict[Hashable, float] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def _expire(self, now: float) -> None:
        while self._entries:
            key, expires = next(iter(self._entries.items()))
            if expires > now and len(self._entries) <= self._size:
                return
            del self._entries[key]

    def add(self, key: Hashable) -> bool:
        """Record ``key``; False when it is already there (a duplicate)."""
        now = self._clock()
        self._expire(now)
        if key in self._entries:
            return False
        self._entries[key] = now + self._ttl
        self._expire(now)
        return True

    def __contains__(self, key: Hashable) -> bool:
        """``key`` was added and has not expired or been evicted."""
        expires = self._entries.get(key)
        return expires is not None and expires > self._clock()

    def discard(self, key: Hashable) -> None:
        self._entries.pop(key, None)
