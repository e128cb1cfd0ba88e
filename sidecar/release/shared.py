"""The spent-parameters ledger and the in-flight veto shared by every worker process (``workers``).

With more than one serving process, a replay of released parameters may reach
any of them, two copies of one rejected request may be judged by two of them
at once, and a request one of them forwarded to D must veto a release that
another would make. So the ledger (``sidecar.release.ledger``) and the veto
(``sidecar.decision.inflight``, ``sidecar.app.shared``) keep their entries in one table in shared memory:
a file the supervisor creates in a private directory (``/dev/shm`` when there
is one), mapped by every worker, each operation taken under an exclusive
``flock`` of the file (the kernel lets go of it if a worker dies holding it).

The table: buckets of 8 slots, a key's bucket picked by its 16-byte BLAKE2b
digest. A slot holds the digest, until when the key is spent (released: a
replay is refused), until when D may read it (admitted, or aborting), and one
count per worker of its requests with the key at D. A lookup reads one bucket
(768 bytes); measured with ``python -m sidecar.release.shared``, about 2-4 us
per operation with the lock, against well under 1 us for the one-process
tables. A full bucket reuses an expired slot, then evicts the entry that
expires first, never one a worker has at D; should all 8 be at D (a table
sized far below the load), the key is counted in the header instead and the
veto holds every release until that request leaves D, rather than forget it.
``reap`` turns a dead worker's requests at D into admitted entries: D may
still read them while it aborts them, so nothing with those parameters is
released within the lease.
"""

from __future__ import annotations

import fcntl
import hashlib
import math
import mmap
import os
import struct
import time
from collections.abc import Callable, Hashable
from pathlib import Path

from sidecar.release.ledger import Ledger

MAX_WORKERS = 32
_SLOTS = 8
_KEY = 16
_TIMES = struct.Struct("<dd")  # spent until, admitted until
_LIVE = struct.Struct(f"<{MAX_WORKERS}H")
_SLOT = _KEY + _TIMES.size + _LIVE.size
_BUCKET = _SLOTS * _SLOT
# magic, buckets, spent entries (not yet reused), overflow: the veto holds every release until
# then; then per worker, its requests at D that found no slot (the veto holds while any are)
_HEADER = struct.Struct("<8sQqd")
_OVERFLOW_AT = _HEADER.size
_HEADER_SIZE = 128
_MAGIC = b"KVRSHM01"
_EMPTY = bytes(_KEY)
_LIVE_MAX = 0xFFFF


def _digest(key: Hashable) -> bytes:
    digest = hashlib.blake2b(repr(key).encode(), digest_size=_KEY).digest()
    return digest if digest != _EMPTY else b"\x01" + digest[1:]


class SharedTable:
    """The mapped table; ``create`` once (the supervisor), ``open`` in each worker."""

    def __init__(self, path: Path, clock: Callable[[], float] = time.monotonic) -> None:
        self.path = path
        self._fd = os.open(path, os.O_RDWR)
        self._map = mmap.mmap(self._fd, 0)
        magic, buckets, _, _ = _HEADER.unpack_from(self._map, 0)
        self._buckets = int(buckets)
        if magic != _MAGIC:
            raise ValueError(f"{path}: not a shared ledger table")
        self._clock = clock

    @classmethod
    def create(cls, path: Path, entries: int) -> SharedTable:
        """A zeroed table with room for about ``entries`` keys at half load."""
        buckets = 1 << max(4, math.ceil(math.log2(max(1, 2 * entries) / _SLOTS)))
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, _HEADER_SIZE + buckets * _BUCKET)
            os.pwrite(fd, _HEADER.pack(_MAGIC, buckets, 0, 0.0), 0)
        finally:
            os.close(fd)
        return cls(path)

    @property
    def size_bytes(self) -> int:
        return len(self._map)

    def close(self) -> None:
        self._map.close()
        os.close(self._fd)

    def _lock(self) -> None:
        fcntl.flock(self._fd, fcntl.LOCK_EX)

    def _unlock(self) -> None:
        fcntl.flock(self._fd, fcntl.LOCK_UN)

    # --- slots ----------------------------------------------------------------------------

    def _bucket(self, digest: bytes) -> int:
        return _HEADER_SIZE + (int.from_bytes(digest[:8], "little") & (self._buckets - 1)) * _BUCKET

    def _find(self, digest: bytes) -> int | None:
        base = self._bucket(digest)
        at = self._map.find(digest, base, base + _BUCKET)
        while at != -1 and (at - base) % _SLOT:  # the digest's bytes inside another field
            at = self._map.find(digest, at + 1, base + _BUCKET)
        return None if at == -1 else at

    def _times(self, slot: int) -> tuple[float, float]:
        spent, admitted = _TIMES.unpack_from(self._map, slot + _KEY)
        return spent, admitted

    def _live(self, slot: int) -> tuple[int, ...]:
        return _LIVE.unpack_from(self._map, slot + _KEY + _TIMES.size)

    def _claim(self, digest: bytes, now: float) -> int | None:
        """The key's slot, made if need be (None: every slot of its bucket is at D)."""
        found = self._find(digest)
        if found is not None:
            return found
        base, best, best_until = self._bucket(digest), None, math.inf
        for slot in range(base, base + _BUCKET, _SLOT):
            if self._map[slot : slot + _KEY] == _EMPTY:
                best, best_until = slot, -math.inf
                break
            if any(self._live(slot)):
                continue
            spent, admitted = self._times(slot)
            until = max(spent, admitted) if max(spent, admitted) >= now else -1.0  # expired first
            if until < best_until:
                best, best_until = slot, until
        if best is None:
            return None
        if self._times(best)[0] > 0:
            self._count(-1)  # a spent entry reused (expired) or evicted
        self._map[best : best + _SLOT] = digest + bytes(_SLOT - _KEY)
        return best

    def _count(self, change: int) -> None:
        magic, buckets, count, overflow = _HEADER.unpack_from(self._map, 0)
        _HEADER.pack_into(self._map, 0, magic, buckets, max(0, count + change), overflow)

    def _set_times(self, slot: int, spent: float, admitted: float) -> None:
        _TIMES.pack_into(self._map, slot + _KEY, spent, admitted)

    # --- the ledger -----------------------------------------------------------------------

    def spend(self, key: Hashable, ttl: float) -> bool:
        """Record ``key`` as spent for ``ttl``; False when it already is (a duplicate)."""
        digest, now = _digest(key), self._clock()
        self._lock()
        try:
            slot = self._claim(digest, now)
            if slot is None:
                return True  # no room: a second release of one key is harmless to P, a missed one is not
            spent, admitted = self._times(slot)
            if spent >= now:
                return False
            if spent == 0:
                self._count(1)
            self._set_times(slot, now + ttl, admitted)
            return True
        finally:
            self._unlock()

    def spent(self, key: Hashable) -> bool:
        digest, now = _digest(key), self._clock()
        self._lock()
        try:
            slot = self._find(digest)
            return slot is not None and self._times(slot)[0] >= now
        finally:
            self._unlock()

    def unspend(self, key: Hashable) -> None:
        self._lock()
        try:
            slot = self._find(_digest(key))
            if slot is not None and self._times(slot)[0] > 0:
                self._set_times(slot, 0.0, self._times(slot)[1])
                self._count(-1)
        finally:
            self._unlock()

    def spent_entries(self) -> int:
        """Keys spent and not yet reused (expired ones among them until their slot is reused)."""
        self._lock()
        try:
            return int(_HEADER.unpack_from(self._map, 0)[2])
        finally:
            self._unlock()

    # --- the veto -------------------------------------------------------------------------

    def at_decode(self, key: Hashable, worker: int, change: int) -> None:
        """``worker`` has one request more (``change`` 1) or fewer (-1) with ``key`` at D."""
        digest, now = _digest(key), self._clock()
        self._lock()
        try:
            slot = self._claim(digest, now) if change > 0 else self._find(digest)
            # no slot: counted per worker in the header, and the veto holds every release meanwhile
            at = _OVERFLOW_AT + 2 * worker if slot is None else slot + _KEY + _TIMES.size + 2 * worker
            (count,) = struct.unpack_from("<H", self._map, at)
            struct.pack_into("<H", self._map, at, min(_LIVE_MAX, max(0, count + change)))
        finally:
            self._unlock()

    def admit(self, key: Hashable, ttl: float) -> None:
        """D may read ``key`` for ``ttl`` seconds."""
        digest, now = _digest(key), self._clock()
        self._lock()
        try:
            slot = self._claim(digest, now)
            if slot is None:
                self._overflow(now + ttl)
                return
            spent, admitted = self._times(slot)
            self._set_times(slot, spent, max(admitted, now + ttl))
        finally:
            self._unlock()

    def may_be_read(self, key: Hashable) -> bool:
        digest, now = _digest(key), self._clock()
        self._lock()
        try:
            if _HEADER.unpack_from(self._map, 0)[3] >= now or any(_LIVE.unpack_from(self._map, _OVERFLOW_AT)):
                return True
            slot = self._find(digest)
            return slot is not None and (self._times(slot)[1] >= now or any(self._live(slot)))
        finally:
            self._unlock()

    def _overflow(self, until: float) -> None:
        magic, buckets, count, overflow = _HEADER.unpack_from(self._map, 0)
        _HEADER.pack_into(self._map, 0, magic, buckets, count, max(overflow, until))

    def reap(self, worker: int, ttl: float) -> int:
        """A dead worker's requests at D: admitted for ``ttl`` (D aborts them, and may read
        meanwhile); returns how many keys it had at D."""
        now, found, at = self._clock(), 0, _KEY + _TIMES.size + 2 * worker
        self._lock()
        try:
            for slot in range(_HEADER_SIZE, len(self._map), _SLOT):
                if self._map[at + slot : at + slot + 2] != b"\0\0":
                    struct.pack_into("<H", self._map, slot + at, 0)
                    spent, admitted = self._times(slot)
                    self._set_times(slot, spent, max(admitted, now + ttl))
                    found += 1
            if self._map[_OVERFLOW_AT + 2 * worker : _OVERFLOW_AT + 2 * worker + 2] != b"\0\0":
                struct.pack_into("<H", self._map, _OVERFLOW_AT + 2 * worker, 0)
                self._overflow(now + ttl)  # requests at D not known by key: every release held
        finally:
            self._unlock()
        return found


class SharedLedger(Ledger):
    """``Ledger`` on the shared table."""

    def __init__(self, table: SharedTable, ttl: float) -> None:
        self._table, self._ttl = table, ttl

    def __len__(self) -> int:
        return self._table.spent_entries()

    def add(self, key: Hashable) -> bool:
        return self._table.spend(key, self._ttl)

    def __contains__(self, key: Hashable) -> bool:
        return self._table.spent(key)

    def discard(self, key: Hashable) -> None:
        self._table.unspend(key)


def main() -> None:  # pragma: no cover - a measurement, run by hand
    """``python -m sidecar.release.shared``: what one operation costs, shared and not."""
    import tempfile

    with tempfile.TemporaryDirectory() as scratch:
        table = SharedTable.create(Path(scratch) / "table", 131072)
        ledger, local = SharedLedger(table, 600.0), Ledger(65536, 600.0)
        keys = [("engine", f"request-{i}") for i in range(50_000)]
        for name, add, has, fwd in (
            ("shared", ledger.add, ledger.__contains__, lambda k: table.at_decode(k, 0, 1)),
            ("one process", local.add, local.__contains__, lambda k: None),
        ):
            for label, op in (("add", add), ("contains", has), ("at D +1", fwd)):
                start = time.perf_counter()
                for key in keys:
                    op(key)
                per = (time.perf_counter() - start) / len(keys) * 1e6
                print(f"{name:<12} {label:<10} {per:.2f} us")
        table.close()


if __name__ == "__main__":  # pragma: no cover
    main()
