"""The in-flight veto's part of the shared table: a shard per worker, written by its worker alone.

Each worker records in its own shard its requests at D and what D admitted
through it; a release decision reads the key's bucket in every shard, and
every shard's header (``sidecar.release.shared`` has the whole design).
"""

from __future__ import annotations

import fcntl
import os
import time
from collections import Counter
from collections.abc import Callable, Hashable
from pathlib import Path

from sidecar.release.table import (
    _BUCKET,
    _EMPTY,
    _FLOCK,
    _LIVE_MAX,
    _SLOT,
    _SLOTS,
    LOCK_PATIENCE,
    Table,
    Unsettled,
    _digest,
    _nonzero,
    log,
)


class VetoTable(Table):
    """The veto's operations on the table."""

    def __init__(
        self, path: Path, clock: Callable[[], float] = time.monotonic, patience: float = LOCK_PATIENCE
    ) -> None:
        super().__init__(path, clock, patience)
        # This process's own shard: its requests at D counted in the header (no slot, or their
        # bucket held by a reader), and the writes to buckets held by a reader, made at the next
        # operation (worker, digest, change, admitted until).
        self._headed: Counter[bytes] = Counter()
        self._later: list[tuple[int, bytes, int, float]] = []

    def _shard(self, worker: int, digest: bytes) -> int:
        if not 0 <= worker < self.shards:
            raise ValueError(f"worker index {worker} outside 0..{self.shards - 1}")
        return self._bucket(self._veto + worker * self._veto_buckets * _BUCKET, self._veto_buckets, digest)

    def _head(self, worker: int, count: int = 0, until: float = 0.0, dead: float | None = None) -> None:
        """Add ``count`` to the worker's requests at D counted in its header; hold every release
        until ``until``. ``dead``: the worker died, its count goes, and every release is held
        until then if it counted any (unknown by key) or died writing the header. Waits for the
        header only while readers stopped inside it and inside the key's bucket at once: two
        stopped workers (or, for ``reap``, one reading every header)."""
        at = self._heads + worker * _SLOT.size
        if not self._take(fcntl.F_WRLCK, at, _SLOT.size, self._patience):
            log.warning("the shared veto's header is held by stopped workers; waiting for it")
            lock = _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, at, _SLOT.size, 0)
            fcntl.fcntl(self._fd, fcntl.F_OFD_SETLKW, lock)
        try:
            writing, now_count, now_until, _ = _SLOT.unpack_from(self._map, at)
            if dead is not None:
                until = max(until, dead) if writing or now_count else until
                count = -now_count
            self._write(at, min(_LIVE_MAX, max(0, now_count + count)), max(now_until, until), _EMPTY)
        finally:
            self._drop(at, _SLOT.size)

    def _veto_write(
        self, worker: int, digest: bytes, change: int, until: float, now: float, patience: float
    ) -> bool:
        """``change`` and ``until`` written to the key's slot in the worker's shard; False when a
        reader holds the bucket past ``patience`` (nothing written)."""
        if (
            change < 0 and self._headed and self._headed[digest]
        ):  # its +1 went to the header: taken back there
            # Admitted first, in its slot if that is free now, else in the header (every release
            # held for that long), then off the header: never neither at D nor admitted.
            if until and not self._veto_write(worker, digest, 0, until, now, 0.0):
                self._head(worker, 0, until)
            self._headed[digest] -= 1
            if not self._headed[digest]:
                del self._headed[digest]
            self._head(worker, change)
            return True
        base = self._shard(worker, digest)
        if not self._take(fcntl.F_WRLCK, base, _BUCKET, patience):
            return False
        try:
            if change > 0 or until:
                claimed = self._claim(base, digest, now)
            else:
                found = self._find(self._map[base : base + _BUCKET], digest)
                if found is None:
                    claimed = None
                else:
                    _, count, admitted, _ = _SLOT.unpack_from(self._map, base + found)
                    claimed = base + found, count, admitted
            if claimed is None:  # no free slot: counted in the header, and every release held meanwhile
                if change > 0:
                    self._headed[digest] += change
                change = max(0, change)  # a -1 finds its slot or the header; nothing else to take back
                self._head(worker, change, until)
                return True
            slot, count, admitted = claimed
            self._write(slot, min(_LIVE_MAX, max(0, count + change)), max(admitted, until), digest)
            return True
        finally:
            self._drop(base, _BUCKET)

    def at_decode(self, key: Hashable, worker: int, change: int, admit: float | None = None) -> None:
        """``worker`` has one request more (``change`` 1) or fewer (-1) with ``key`` at D; with
        ``admit``, D may read ``key`` for that many seconds (written with the count, at once)."""
        digest, now = _digest(key), self._clock()
        until = 0.0 if admit is None else now + admit
        with self._turn:
            if self._later:
                self._catch_up(now)
            if self._veto_write(worker, digest, change, until, now, self._patience):
                return
            # A reader stopped inside the key's bucket: nothing written there.
            if change > 0:
                self._headed[digest] += change
                self._head(worker, change, until)  # at D from now: every release held meanwhile
            elif change < 0:
                self._later.append((worker, digest, change, until))  # still at D meanwhile: safe
            else:
                self._head(worker, 0, until)  # admitted: every release held for that long

    def _catch_up(self, now: float) -> None:
        """The writes a reader's lock put off, in order, as far as their buckets are free now."""
        later, self._later = self._later, []
        for at, (worker, digest, change, until) in enumerate(later):
            if not self._veto_write(worker, digest, change, until, now, 0.0):
                self._later = later[at:]
                return

    def admit(self, key: Hashable, worker: int, ttl: float) -> None:
        """D may read ``key`` for ``ttl`` seconds (it admitted it through ``worker``)."""
        self.at_decode(key, worker, 0, ttl)

    def may_be_read(self, key: Hashable) -> bool:
        """A worker has ``key`` at D, D admitted it within the lease, or a shard cannot tell."""
        digest, now = _digest(key), self._clock()
        with self._turn:
            if self._later:
                self._catch_up(now)  # this worker's own writes first, if they can be made now
            try:
                for _, count, until, _ in _SLOT.iter_unpack(
                    self._read(self._heads, self.shards * _SLOT.size)
                ):
                    if count or until >= now:
                        return True
                for worker in range(self.shards):
                    bucket = self._read(self._shard(worker, digest), _BUCKET)
                    found = self._find(bucket, digest)
                    if found is not None:
                        _, count, until, _ = _SLOT.unpack_from(bucket, found)
                        if count or until >= now:
                            return True
            except Unsettled:
                return True  # a writer stopped mid-write: it may be writing this key
        return False

    def reap(self, worker: int, ttl: float) -> int:
        """A dead worker's requests at D: admitted for ``ttl`` (D aborts them, and may read
        meanwhile); returns how many keys it had at D. Its shard has no other writer; a bucket
        a reader holds past ``LOCK_PATIENCE`` keeps its counts, and every release is held."""
        if not 0 <= worker < self.shards:
            raise ValueError(f"worker index {worker} outside 0..{self.shards - 1}")
        with self._turn:
            now, found, hold = self._clock(), 0, False
            start = self._veto + worker * self._veto_buckets * _BUCKET
            length = self._veto_buckets * _BUCKET
            if not self._take(fcntl.F_RDLCK, start, length, self._patience):
                self._head(worker, 0, now + ttl, dead=now + ttl)
                return 0
            try:
                shard = self._map[start : start + length]
            finally:
                self._drop(start, length)
            words = memoryview(shard).cast("I")  # a slot: writing, count, until (2), digest (4)
            fields = _SLOT.size // 4
            busy = _nonzero(words[0::fields].tobytes(), 4) | _nonzero(words[1::fields].tobytes(), 4)
            marked = {at // _SLOTS for at in busy}
            for bucket in sorted(marked):
                base = start + bucket * _BUCKET
                if not self._take(fcntl.F_WRLCK, base, _BUCKET, self._patience):
                    hold = True
                    continue
                try:
                    for slot in range(base, base + _BUCKET, _SLOT.size):
                        writing, count, admitted, digest = _SLOT.unpack_from(self._map, slot)
                        hold = hold or bool(writing)  # died writing it: which key is unknown
                        if count or writing:
                            self._write(slot, 0, max(admitted, now + ttl), digest)
                            found += 1
                finally:
                    self._drop(base, _BUCKET)
            self._head(worker, 0, now + ttl if hold else 0.0, dead=now + ttl)
            return found
