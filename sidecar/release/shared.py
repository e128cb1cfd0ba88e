"""The spent-parameters ledger and the in-flight veto shared by every worker process (``workers``).

With more than one serving process, a replay of released parameters may reach
any of them, two copies of one rejected request may be judged by two of them
at once, and a request one of them forwarded to D must veto a release that
another would make. So the ledger (``sidecar.release.ledger``) and the veto
(``sidecar.decision.inflight``, ``sidecar.app.shared``) keep their entries in one file in
shared memory that the supervisor creates in a private directory (``/dev/shm``
when there is one) and every worker maps.

No worker ever waits on another's progress: a worker stopped or descheduled
mid-operation (SIGSTOP, a CPU quota, an oversubscribed node) stalls nobody
else. The veto is sharded: each worker writes only its own shard (its requests
at D, what D admitted through it) and readers scan every shard without a lock.
Every slot, and each shard's header, carries a sequence number its writer
makes odd while it writes (a seqlock); a reader copies a bucket twice and
trusts it only when both copies match and no sequence is odd. A bucket still
being written after a few tries gets the answer that is safe: "D may be
reading these" (no release) and "these are spent" (a replay refused 409). The
ledger's one shared region needs a test-and-set (two workers judging copies
of one request release it once), so its writers take a ``flock`` of the file
without waiting for it: a worker that finds it held for more than
``LOCK_PATIENCE`` does not record the release, and so does not make it (P's
lease frees those blocks); every check the request path makes is a read.

A bucket holds 8 slots of 32 bytes, a key's bucket picked by its 16-byte
BLAKE2b digest. A full bucket reuses an expired slot, then evicts the entry
that expires first, never one its worker has at D; should all 8 be at D, the
key is counted in the shard's header and the veto holds every release until
that request leaves D. ``reap`` turns a dead worker's requests at D (and any
slot it died writing) into entries D may read for the lease. The x86-64 and
arm64 orders of stores differ: the seqlock relies on stores becoming visible
in program order (x86-64, TSO); ``python -m sidecar.release.shared`` measures
what one operation costs.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import math
import mmap
import os
import struct
import time
from collections.abc import Callable, Hashable
from pathlib import Path

from sidecar.release.ledger import Ledger

log = logging.getLogger("sidecar.release")
MAX_WORKERS = 32
LOCK_PATIENCE = 0.02  # seconds a ledger write tries for the lock before giving up on it
_TRIES = 4  # copies of a bucket a reader makes before it takes the safe answer
_SLOTS = 8
_KEY = 16
# seq (odd while written), count (veto: this worker's requests at D), until (spent / admitted), digest
_SLOT = struct.Struct(f"<IId{_KEY}s")
_BUCKET = _SLOTS * _SLOT.size
_SEQ = struct.Struct("<I")
# magic, ledger buckets, veto buckets per shard, shards, spent entries (not yet reused)
_HEADER = struct.Struct("<8sQQQq")
_HEADER_SIZE = 64
_MAGIC = b"KVRSHM02"
_EMPTY = bytes(_KEY)
_LIVE_MAX = 0xFFFFFFFF
_ODD = bytes(i & 1 for i in range(256))  # a sequence's low byte -> 1 when odd


def _digest(key: Hashable) -> bytes:
    digest = hashlib.blake2b(repr(key).encode(), digest_size=_KEY).digest()
    return digest if digest != _EMPTY else b"\x01" + digest[1:]


def _buckets(entries: int) -> int:
    return 1 << max(4, math.ceil(math.log2(max(1, 2 * entries) / _SLOTS)))


class Unsettled(Exception):
    """A bucket some writer is in the middle of writing (or died writing)."""


class SharedTable:
    """The mapped table; ``create`` once (the supervisor), ``open`` in each worker."""

    def __init__(
        self, path: Path, clock: Callable[[], float] = time.monotonic, patience: float = LOCK_PATIENCE
    ) -> None:
        self.path, self._patience, self._stuck = path, patience, False
        self._fd = os.open(path, os.O_RDWR)
        self._map = mmap.mmap(self._fd, 0)
        magic, ledger, veto, shards, _ = _HEADER.unpack_from(self._map, 0)
        if magic != _MAGIC:
            raise ValueError(f"{path}: not a shared ledger table")
        self._ledger_buckets, self._veto_buckets, self.shards = int(ledger), int(veto), int(shards)
        self._heads = _HEADER_SIZE  # one slot per shard: seq, at D without a slot, overflow until
        self._ledger = self._heads + self.shards * _SLOT.size
        self._veto = self._ledger + self._ledger_buckets * _BUCKET
        self._clock = clock

    @classmethod
    def create(cls, path: Path, entries: int, workers: int = MAX_WORKERS) -> SharedTable:
        """A zeroed table with room for about ``entries`` spent keys and as many at D or admitted
        (shared among ``workers`` shards, with room for twice a worker's share in each)."""
        ledger, veto = _buckets(entries), _buckets(2 * math.ceil(entries / workers))
        size = _HEADER_SIZE + workers * _SLOT.size + (ledger + workers * veto) * _BUCKET
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, size)
            os.pwrite(fd, _HEADER.pack(_MAGIC, ledger, veto, workers, 0), 0)
        finally:
            os.close(fd)
        return cls(path)

    @property
    def size_bytes(self) -> int:
        return len(self._map)

    def close(self) -> None:
        self._map.close()
        os.close(self._fd)

    # --- slots ----------------------------------------------------------------------------

    def _read(self, base: int, length: int) -> bytes:
        """A consistent copy of ``length`` bytes of slots at ``base`` (seqlock), or Unsettled."""
        for _ in range(_TRIES):
            first = self._map[base : base + length]
            if first == self._map[base : base + length] and 1 not in first[:: _SLOT.size].translate(_ODD):
                return first
        raise Unsettled

    def _write(self, slot: int, count: int, until: float, digest: bytes) -> None:
        """Rewrite ``slot``; only its one writer calls this (the shard's worker, or the lock holder)."""
        (seq,) = _SEQ.unpack_from(self._map, slot)
        seq |= 1  # odd: being written (already odd when the last writer died mid-write)
        _SEQ.pack_into(self._map, slot, seq)
        _SLOT.pack_into(self._map, slot, seq, count, until, digest)
        _SEQ.pack_into(self._map, slot, (seq + 1) & 0xFFFFFFFF)

    def _bucket(self, region: int, buckets: int, digest: bytes) -> int:
        return region + (int.from_bytes(digest[:8], "little") & (buckets - 1)) * _BUCKET

    @staticmethod
    def _find(bucket: bytes, digest: bytes) -> int | None:
        """The offset in ``bucket`` of the slot holding ``digest``."""
        at = bucket.find(digest)
        while at != -1 and (at - _SEQ.size - 4 - 8) % _SLOT.size:  # its bytes inside another field
            at = bucket.find(digest, at + 1)
        return None if at == -1 else at - (_SLOT.size - _KEY)

    def _claim(self, base: int, digest: bytes, now: float) -> tuple[int, int, float] | None:
        """The key's slot in the bucket at ``base`` (count, until), made if need be; None: every
        slot is at D. Only the bucket's writer calls this, so it reads without the seqlock."""
        bucket = self._map[base : base + _BUCKET]
        found = self._find(bucket, digest)
        if found is not None:
            _, count, until, _ = _SLOT.unpack_from(bucket, found)
            return base + found, count, until
        best, best_until = None, math.inf
        for at in range(0, _BUCKET, _SLOT.size):
            _, count, until, key = _SLOT.unpack_from(bucket, at)
            if key == _EMPTY:
                best, best_until = at, -math.inf
                break
            if count == 0 and (rank := until if until >= now else -1.0) < best_until:  # expired first
                best, best_until = at, rank
        if best is None:
            return None
        if self._ledger <= base < self._veto and _SLOT.unpack_from(bucket, best)[2] > 0:
            self._count(-1)  # a spent entry reused (expired) or evicted
        return base + best, 0, 0.0

    # --- the ledger: one region, written under a lock never waited on ---------------------

    def _lock(self) -> bool:
        """The ledger's lock, tried for ``patience`` seconds; not at all again until it is free,
        once its holder kept it that long (it may be stopped: every release would wait)."""
        deadline = time.monotonic() + (0.0 if self._stuck else self._patience)
        while True:
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                self._stuck = False
                return True
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    if not self._stuck:
                        log.warning(
                            "the shared ledger's lock is held by a stopped or starved worker; "
                            "no release is made until it lets go"
                        )
                    self._stuck = True
                    return False
                os.sched_yield()

    def _unlock(self) -> None:
        fcntl.flock(self._fd, fcntl.LOCK_UN)

    def _count(self, change: int) -> None:
        at = _HEADER.size - 8
        (count,) = struct.unpack_from("<q", self._map, at)
        struct.pack_into("<q", self._map, at, max(0, count + change))

    def spend(self, key: Hashable, ttl: float) -> bool:
        """Record ``key`` as spent for ``ttl``; False when it already is (a duplicate), or when
        it cannot be recorded now (the lock held past ``LOCK_PATIENCE``): a release the ledger
        does not hold would let a replay reach D, so it is not made."""
        digest, now = _digest(key), self._clock()
        if not self._lock():
            return False
        try:
            base = self._bucket(self._ledger, self._ledger_buckets, digest)
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
            self._unlock()

    def _repair(self, base: int, length: int, until: float) -> None:
        """Settle the ledger's slots a writer died writing (under the lock): spent until ``until``,
        as the key it was writing may be."""
        odd = self._map[base : base + length : _SLOT.size].translate(_ODD)
        at = odd.find(1)
        while at != -1:
            slot = base + at * _SLOT.size
            _, _, spent, digest = _SLOT.unpack_from(self._map, slot)
            if spent == 0:
                self._count(1)
            self._write(slot, 0, max(spent, until), digest)
            at = odd.find(1, at + 1)

    def repair(self, ttl: float) -> None:
        """Settle every ledger slot a dead worker left half written (the supervisor, after a
        worker died); skipped if the lock is not to be had (``spend`` settles its own bucket)."""
        if self._lock():
            try:
                self._repair(self._ledger, self._veto - self._ledger, self._clock() + ttl)
            finally:
                self._unlock()

    def spent(self, key: Hashable) -> bool:
        """Whether ``key`` is spent; True while its bucket is being written (a replay refused
        409 is an error the client sees; a replay that reaches D reads freed blocks)."""
        digest = _digest(key)
        base = self._bucket(self._ledger, self._ledger_buckets, digest)
        try:
            bucket = self._read(base, _BUCKET)
        except Unsettled:
            return True
        found = self._find(bucket, digest)
        return found is not None and _SLOT.unpack_from(bucket, found)[2] >= self._clock()

    def unspend(self, key: Hashable) -> None:
        """Forget ``key`` (its release was not sent); left spent if the lock is not to be had."""
        digest = _digest(key)
        if not self._lock():
            return
        try:
            base = self._bucket(self._ledger, self._ledger_buckets, digest)
            found = self._find(self._map[base : base + _BUCKET], digest)
            if found is not None and _SLOT.unpack_from(self._map, base + found)[2] > 0:
                self._write(base + found, 0, 0.0, digest)
                self._count(-1)
        finally:
            self._unlock()

    def spent_entries(self) -> int:
        """Keys spent and not yet reused (expired ones among them until their slot is reused)."""
        return int(_HEADER.unpack_from(self._map, 0)[4])

    # --- the veto: a shard per worker, each written by its worker alone -------------------

    def _shard(self, worker: int, digest: bytes) -> int:
        if not 0 <= worker < self.shards:
            raise ValueError(f"worker index {worker} outside 0..{self.shards - 1}")
        return self._bucket(self._veto + worker * self._veto_buckets * _BUCKET, self._veto_buckets, digest)

    def _head(self, worker: int, count: int = 0, until: float = 0.0) -> None:
        """Add ``count`` to the worker's requests at D that found no slot; hold every release
        until ``until``."""
        at = self._heads + worker * _SLOT.size
        _, now_count, now_until, _ = _SLOT.unpack_from(self._map, at)
        self._write(at, min(_LIVE_MAX, max(0, now_count + count)), max(now_until, until), _EMPTY)

    def at_decode(self, key: Hashable, worker: int, change: int, admit: float | None = None) -> None:
        """``worker`` has one request more (``change`` 1) or fewer (-1) with ``key`` at D; with
        ``admit``, D may read ``key`` for that many seconds (written with the count, at once)."""
        digest, now = _digest(key), self._clock()
        base = self._shard(worker, digest)
        claimed = self._claim(base, digest, now) if change > 0 or admit is not None else None
        if claimed is None and change <= 0:
            bucket = self._map[base : base + _BUCKET]
            found = self._find(bucket, digest)
            claimed = None if found is None else (base + found, *_SLOT.unpack_from(bucket, found)[1:3])
        until = 0.0 if admit is None else now + admit
        if claimed is None:  # no slot: counted in the header, and every release held meanwhile
            self._head(worker, change, until)
            return
        slot, count, admitted = claimed
        self._write(slot, min(_LIVE_MAX, max(0, count + change)), max(admitted, until), digest)
        if change < 0 and count == 0:  # its +1 found no slot
            self._head(worker, change)

    def admit(self, key: Hashable, worker: int, ttl: float) -> None:
        """D may read ``key`` for ``ttl`` seconds (it admitted it through ``worker``)."""
        self.at_decode(key, worker, 0, ttl)

    def may_be_read(self, key: Hashable) -> bool:
        """A worker has ``key`` at D, D admitted it within the lease, or a shard cannot tell."""
        digest, now = _digest(key), self._clock()
        try:
            for _, count, until, _ in _SLOT.iter_unpack(self._read(self._heads, self.shards * _SLOT.size)):
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
        meanwhile); returns how many keys it had at D. Its shard has no other writer."""
        now, found = self._clock(), 0
        start = self._veto + worker * self._veto_buckets * _BUCKET
        for slot in range(start, start + self._veto_buckets * _BUCKET, _SLOT.size):
            seq, count, admitted, digest = _SLOT.unpack_from(self._map, slot)
            if seq & 1:  # died writing it: which key is unknown, so every release is held
                self._head(worker, 0, now + ttl)
            if count or seq & 1:
                self._write(slot, 0, max(admitted, now + ttl), digest)
                found += 1
        head = self._heads + worker * _SLOT.size
        seq, count, _, _ = _SLOT.unpack_from(self._map, head)
        if count or seq & 1:  # requests at D not known by key: every release held
            self._head(worker, -count, now + ttl)
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
