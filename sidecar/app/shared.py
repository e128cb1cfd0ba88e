"""The in-flight veto on the table every worker process shares (``sidecar.release.shared``)."""

from __future__ import annotations

from collections.abc import Hashable

from sidecar.decision.judge import InFlight
from sidecar.release.shared import SharedTable


class SharedInFlight(InFlight):
    """``InFlight`` on the shared table, as worker ``worker`` sees it (it writes its own shard)."""

    def __init__(self, table: SharedTable, worker: int, ttl: float) -> None:
        if not 0 <= worker < table.shards:
            raise ValueError(f"worker index {worker} outside 0..{table.shards - 1}")
        self._table, self._worker, self._ttl = table, worker, ttl

    def forwarded(self, key: Hashable) -> None:
        self._table.at_decode(key, self._worker, 1)

    def finished(self, key: Hashable, admitted: bool) -> None:
        # One write: no moment when the request has left D and is not yet admitted.
        self._table.at_decode(key, self._worker, -1, self._ttl if admitted else None)

    def admitted(self, key: Hashable) -> None:
        self._table.admit(key, self._worker, self._ttl)

    def may_be_read(self, key: Hashable) -> bool:
        return self._table.may_be_read(key)
