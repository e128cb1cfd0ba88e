"""The in-flight veto on the table every worker process shares (``sidecar.release.shared``)."""

from __future__ import annotations

from collections.abc import Hashable

from sidecar.decision.inflight import InFlight
from sidecar.release.shared import MAX_WORKERS, SharedTable


class SharedInFlight(InFlight):
    """``InFlight`` on the shared table, as worker ``worker`` sees it."""

    def __init__(self, table: SharedTable, worker: int, ttl: float) -> None:
        if not 0 <= worker < MAX_WORKERS:
            raise ValueError(f"worker index {worker} outside 0..{MAX_WORKERS - 1}")
        self._table, self._worker, self._ttl = table, worker, ttl

    def forwarded(self, key: Hashable) -> None:
        self._table.at_decode(key, self._worker, 1)

    def finished(self, key: Hashable, admitted: bool) -> None:
        self._table.at_decode(key, self._worker, -1)
        if admitted:
            self.admitted(key)

    def admitted(self, key: Hashable) -> None:
        self._table.admit(key, self._ttl)

    def may_be_read(self, key: Hashable) -> bool:
        return self._table.may_be_read(key)
