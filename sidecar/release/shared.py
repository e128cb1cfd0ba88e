"""The spent-parameters ledger and the in-flight veto shared by every worker process (``workers``).

With more than one serving process, a replay of released parameters may reach
any of them, two copies of one rejected request may be judged by two of them
at once, and a request one of them forwarded to D must veto a release that
another would make. So the ledger (``sidecar.release.ledger``) and the veto
(``sidecar.decision.inflight``, ``sidecar.app.shared``) keep their entries in one file in
shared memory that the supervisor creates in a private directory (``/dev/shm``
when there is one) and every worker maps.

Right on every CPU Linux runs on, by construction: no byte of the table is
read or written without a lock on its range (but the header's sizes, written
before any worker starts), so nothing depends on the order
in which a CPU makes stores visible (x86-64 keeps that order; arm64 does not,
and Python writes the mapping through ``memcpy``, without barriers). The locks
are Linux's open-file-description byte-range locks (``fcntl`` ``F_OFD_SETLK``),
one range per bucket: its writer holds it exclusive, a reader shared. The
kernel grants a lock only once every conflicting one is dropped, and it takes
and drops them under a spinlock of the file (``spin_unlock`` a release,
``spin_lock`` an acquire): every store a holder made before dropping a lock,
whatever their order, happens before every load of whoever takes the range
next. A process that dies drops its locks as the kernel closes its files, so a
writer killed mid-write leaves its slot's ``writing`` flag set (set first,
cleared last, under the lock): readers then take the slot as unknown.

No worker ever waits on another's progress: every lock is tried without
blocking, for a bounded time (``READ_PATIENCE``, ``LOCK_PATIENCE``), and a
range still held then, by a worker stopped or descheduled inside it (SIGSTOP,
a CPU quota, an oversubscribed node), gets the answer that is safe: "D may be
reading these" (no release) and "these are spent" (a replay refused 409). The
veto is sharded: each worker writes only its own shard (its requests at D,
what D admitted through it), so its own writes wait on no other writer; a
reader stopped holding one of its buckets sends a request at D to the shard's
header instead (which holds every release while it counts one), and a
request's leaving D is written at the worker's next operation (held as at D
meanwhile). The ledger's one region needs a test-and-set (two workers judging
copies of one request release it once), so its writers also take one writer
lock: a worker that finds it held for more than ``LOCK_PATIENCE`` does not
record the release, and so does not make it (P's lease frees those blocks).

A bucket holds 8 slots of 32 bytes, a key's bucket picked by its 16-byte
BLAKE2b digest. A full bucket reuses an expired slot, then evicts the entry
that expires first, never one its worker has at D; should all 8 be at D, the
key is counted in the shard's header and the veto holds every release until
that request leaves D. ``reap`` turns a dead worker's requests at D (and any
slot it died writing) into entries D may read for the lease. ``python -m
sidecar.release.shared`` measures what one operation costs.
"""

from __future__ import annotations

import fcntl
import struct
import time
from collections.abc import Hashable
from pathlib import Path

from sidecar.release.ledger import Ledger
from sidecar.release.table import _BUCKET, _HEADER, _SLOT, _SLOTS, _WRITERS, Unsettled, _digest, _nonzero, log
from sidecar.release.veto_table import VetoTable


class SharedTable(VetoTable):
    """The whole table: the ledger's operations here, the veto's (``VetoTable``), the file's
    (``sidecar.release.table.Table``)."""

    def _dropped(self, base: int) -> None:
        if self._ledger <= base < self._veto:
            self._count(-1)  # a spent entry reused (expired) or evicted

    def _lock(self) -> bool:
        """The ledger's writer lock, tried for ``patience`` seconds; not at all again until it is
        free, once its holder kept it that long (it may be stopped: every release would wait)."""
        if self._take(fcntl.F_WRLCK, *_WRITERS, 0.0 if self._stuck else self._patience):
            self._stuck = False
            return True
        if not self._stuck:
            log.warning(
                "the shared ledger's lock is held by a stopped or starved worker; "
                "no release is made until it lets go"
            )
        self._stuck = True
        return False

    def _unlock(self) -> None:
        self._drop(*_WRITERS)

    def _count(self, change: int) -> None:
        """The spent entries' count, in the header; the caller holds the writer lock."""
        at = _HEADER.size - 8
        (count,) = struct.unpack_from("<q", self._map, at)
        self._spent = max(0, count + change)
        struct.pack_into("<q", self._map, at, self._spent)

    def _ledger_slot(self, key: Hashable) -> tuple[bytes, int]:
        digest = _digest(key)
        return digest, self._bucket(self._ledger, self._ledger_buckets, digest)

    def spend(self, key: Hashable, ttl: float) -> bool:
        """Record ``key`` as spent for ``ttl``; False when it already is (a duplicate), or when
        it cannot be recorded now (a lock held past ``LOCK_PATIENCE``): a release the ledger
        does not hold would let a replay reach D, so it is not made."""
        (digest, base), now = self._ledger_slot(key), self._clock()
        with self._turn:
            if not self._lock():
                return False
            try:
                if not self._take(fcntl.F_WRLCK, base, _BUCKET, self._patience):
                    return False  # a reader stopped inside this bucket: not recorded, not released
                try:
                    self._repair(base, _BUCKET, now + ttl)
                    claimed = self._claim(base, digest, now)
                    assert claimed is not None  # ledger slots are never at D
                    slot, _, spent = claimed
                    if spent >= now:
                        return False
                    if spent == 0:
                        self._count(1)
                    self._write(slot, 0, now + ttl, digest)
                    return True
                finally:
                    self._drop(base, _BUCKET)
            finally:
                self._unlock()

    def _repair(self, base: int, length: int, until: float) -> None:
        """Settle the ledger's slots a writer died writing (the caller holds the writer lock and
        theirs): spent until ``until``, as the key it was writing may be."""
        flags = self._map[base : base + length : _SLOT.size]
        at = flags.find(1)
        while at != -1:
            slot = base + at * _SLOT.size
            _, _, spent, digest = _SLOT.unpack_from(self._map, slot)
            if spent == 0:
                self._count(1)
            self._write(slot, 0, max(spent, until), digest)
            at = flags.find(1, at + 1)

    def repair(self, ttl: float) -> None:
        """Settle every ledger slot a dead worker left half written (the supervisor, after a
        worker died); a bucket held by a reader is skipped (``spend`` settles its own bucket)."""
        with self._turn:
            if not self._lock():
                return
            try:
                until = self._clock() + ttl
                start, length = self._ledger, self._veto - self._ledger
                # Shared over the whole region: no writer holds a bucket while we hold theirs.
                if not self._take(fcntl.F_RDLCK, start, length, self._patience):
                    return
                try:
                    flags = self._map[start : start + length : _SLOT.size]
                finally:
                    self._drop(start, length)
                for bucket in sorted({at // _SLOTS for at in _nonzero(flags, 1)}):
                    base = start + bucket * _BUCKET
                    if self._take(fcntl.F_WRLCK, base, _BUCKET, self._patience):
                        try:
                            self._repair(base, _BUCKET, until)
                        finally:
                            self._drop(base, _BUCKET)
            finally:
                self._unlock()

    def spent(self, key: Hashable) -> bool:
        """Whether ``key`` is spent; True while its bucket cannot be read (a replay refused 409 is
        an error the client sees; a replay that reaches D reads freed blocks)."""
        digest, base = self._ledger_slot(key)
        with self._turn:
            try:
                bucket = self._read(base, _BUCKET)
            except Unsettled:
                return True
        found = self._find(bucket, digest)
        return found is not None and _SLOT.unpack_from(bucket, found)[2] >= self._clock()

    def unspend(self, key: Hashable) -> None:
        """Forget ``key`` (its release was not sent); left spent if a lock is not to be had."""
        digest, base = self._ledger_slot(key)
        with self._turn:
            if not self._lock():
                return
            try:
                if not self._take(fcntl.F_WRLCK, base, _BUCKET, self._patience):
                    return
                try:
                    found = self._find(self._map[base : base + _BUCKET], digest)
                    if found is not None and _SLOT.unpack_from(self._map, base + found)[2] > 0:
                        self._write(base + found, 0, 0.0, digest)
                        self._count(-1)
                finally:
                    self._drop(base, _BUCKET)
            finally:
                self._unlock()

    def spent_entries(self) -> int:
        """Keys spent and not yet reused (expired ones among them until their slot is reused); the
        count last seen while a writer holds it."""
        with self._turn:
            if self._take(fcntl.F_RDLCK, *_WRITERS, 0.0):
                try:
                    (spent,) = struct.unpack_from("<q", self._map, _HEADER.size - 8)
                    self._spent = int(spent)
                finally:
                    self._drop(*_WRITERS)
            return self._spent


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
        table = SharedTable.create(Path(scratch) / "table", 131072, workers=2)
        ledger, local = SharedLedger(table, 600.0), Ledger(65536, 600.0)
        keys = [("engine", f"request-{i}") for i in range(50_000)]
        for name, add, has, fwd, read in (
            (
                "shared",
                ledger.add,
                ledger.__contains__,
                lambda k: table.at_decode(k, 0, 1),
                table.may_be_read,
            ),
            ("one process", local.add, local.__contains__, lambda k: None, lambda k: False),
        ):
            for label, op in (("add", add), ("contains", has), ("at D +1", fwd), ("may be read", read)):
                start = time.perf_counter()
                for key in keys:
                    op(key)
                per = (time.perf_counter() - start) / len(keys) * 1e6
                print(f"{name:<12} {label:<12} {per:.2f} us")
        table.close()


if __name__ == "__main__":  # pragma: no cover
    main()
