"""A bounded TTL set of release keys, so a client's retries never release twice."""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable

from sidecar.ttlmap import TTLMap


class Ledger:
    """Keys with an expiry; the least recently added go first when full."""

    def __init__(self, size: int, ttl: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._keys: TTLMap[Hashable, bool] = TTLMap(size, ttl, clock)

    def __len__(self) -> int:
        self._keys.expire()
        return len(self._keys)

    def add(self, key: Hashable) -> bool:
        """Record ``key``; False when it is already there (a duplicate)."""
        if key in self._keys:
            return False
        self._keys[key] = True
        return True

    def __contains__(self, key: Hashable) -> bool:
        """``key`` was added and has not expired or been evicted."""
        return key in self._keys

    def discard(self, key: Hashable) -> None:
        self._keys.pop(key, None)
