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

import errno
import fcntl
import hashlib
import logging
import math
import mmap
import os
import re
import struct
import threading
import time
from collections import Counter
from collections.abc import Callable, Hashable
from pathlib import Path

from sidecar.release.ledger import Ledger

log = logging.getLogger("sidecar.release")
MAX_WORKERS = 32
LOCK_PATIENCE = 0.02  # seconds a write tries for its locks before giving up on them
READ_PATIENCE = 0.002  # seconds a read tries for a bucket before taking the safe answer
_SLOTS = 8
_KEY = 16
# writing (1 while written), count (veto: this worker's requests at D), until (spent / admitted), digest
_SLOT = struct.Struct(f"<IId{_KEY}s")
_BUCKET = _SLOTS * _SLOT.size
_FLAG = struct.Struct("<I")
# magic, ledger buckets, veto buckets per shard, shards, spent entries (not yet reused)
_HEADER = struct.Struct("<8sQQQq")
_HEADER_SIZE = 64
_MAGIC = b"KVRSHM03"
_EMPTY = bytes(_KEY)
_LIVE_MAX = 0xFFFFFFFF
# struct flock on Linux's 64-bit ABIs (x86-64, arm64): type, whence, start, length, pid (0 for OFD locks)
_FLOCK = struct.Struct("=hh4xqqi4x")
_BUSY = (errno.EAGAIN, errno.EACCES)
_WRITERS = (0, 8)  # the ledger's writer lock: a range no bucket uses (the magic)
_NONZERO = re.compile(rb"[^\x00]")


def _digest(key: Hashable) -> bytes:
    digest = hashlib.blake2b(repr(key).encode(), digest_size=_KEY).digest()
    return digest if digest != _EMPTY else b"\x01" + digest[1:]


def _nonzero(data: bytes, width: int) -> set[int]:
    """Which ``width``-byte fields of ``data`` are not zero."""
    return {found.start() // width for found in _NONZERO.finditer(data)}


def _buckets(entries: int) -> int:
    return 1 << max(4, math.ceil(math.log2(max(1, 2 * entries) / _SLOTS)))


class Unsettled(Exception):
    """A bucket some worker holds (stopped or starved inside an operation), or left half written."""


class SharedTable:
    """The mapped table; ``create`` once (the supervisor), ``open`` in each worker. The threads of
    one process share its locks (they are the open file's), so its operations take turns."""

    def __init__(
        self, path: Path, clock: Callable[[], float] = time.monotonic, patience: float = LOCK_PATIENCE
    ) -> None:
        self.path, self._patience, self._stuck = path, patience, False
        self._fd = os.open(path, os.O_RDWR)
        self._map = mmap.mmap(self._fd, 0)
        self._turn = threading.Lock()
        # Written once, before any worker process starts: read without a lock.
        magic, ledger, veto, shards, spent = _HEADER.unpack_from(self._map, 0)
        self._spent = int(spent)
        if magic != _MAGIC:
            raise ValueError(f"{path}: not a shared ledger table")
        self._ledger_buckets, self._veto_buckets, self.shards = int(ledger), int(veto), int(shards)
        self._heads = _HEADER_SIZE  # one slot per shard: at D without a slot, every release held until
        self._ledger = self._heads + self.shards * _SLOT.size
        self._veto = self._ledger + self._ledger_buckets * _BUCKET
        self._clock = clock
        # This process's own shard: its requests at D counted in the header (no slot, or their
        # bucket held by a reader), and the writes to buckets held by a reader, made at the next
        # operation (digest, change, admitted until).
        self._headed: Counter[bytes] = Counter()
        self._later: list[tuple[int, bytes, int, float]] = []

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

    # --- locks: every byte read or written under one --------------------------------------

    def _try(self, kind: int, start: int, length: int) -> bool:
        try:
            fcntl.fcntl(self._fd, fcntl.F_OFD_SETLK, _FLOCK.pack(kind, os.SEEK_SET, start, length, 0))
        except OSError as exc:
            if exc.errno in _BUSY:
                return False
            raise
        return True

    def _take(self, kind: int, start: int, length: int, patience: float) -> bool:
        """Lock ``length`` bytes at ``start`` (``F_RDLCK`` shared, ``F_WRLCK`` exclusive), tried
        without blocking for ``patience`` seconds."""
        if self._try(kind, start, length):
            return True
        deadline = time.monotonic() + patience
        while time.monotonic() < deadline:
            os.sched_yield()
            if self._try(kind, start, length):
                return True
        return False

    def _drop(self, start: int, length: int) -> None:
        fcntl.fcntl(self._fd, fcntl.F_OFD_SETLK, _FLOCK.pack(fcntl.F_UNLCK, os.SEEK_SET, start, length, 0))

    # --- slots ----------------------------------------------------------------------------

    def _read(self, base: int, length: int) -> bytes:
        """A copy of ``length`` bytes of slots at ``base``, made under a shared lock; Unsettled if
        a writer holds them past ``READ_PATIENCE`` or one died writing them."""
        if not self._take(fcntl.F_RDLCK, base, length, READ_PATIENCE):
            raise Unsettled
        try:
            copy = self._map[base : base + length]
        finally:
            self._drop(base, length)
        if any(copy[:: _SLOT.size]):  # a writing flag left set (its low byte)
            raise Unsettled
        return copy

    def _write(self, slot: int, count: int, until: float, digest: bytes) -> None:
        """Rewrite ``slot``; the caller holds its bucket's lock exclusive. The flag first and last:
        a writer killed between leaves it set."""
        _FLAG.pack_into(self._map, slot, 1)
        _SLOT.pack_into(self._map, slot, 1, count, until, digest)
        _FLAG.pack_into(self._map, slot, 0)

    def _bucket(self, region: int, buckets: int, digest: bytes) -> int:
        return region + (int.from_bytes(digest[:8], "little") & (buckets - 1)) * _BUCKET

    @staticmethod
    def _find(bucket: bytes, digest: bytes) -> int | None:
        """The offset in ``bucket`` of the slot holding ``digest``."""
        at = bucket.find(digest)
        while at != -1 and (at - _FLAG.size - 4 - 8) % _SLOT.size:  # its bytes inside another field
            at = bucket.find(digest, at + 1)
        return None if at == -1 else at - (_SLOT.size - _KEY)

    def _claim(self, base: int, digest: bytes, now: float) -> tuple[int, int, float] | None:
        """The key's slot in the bucket at ``base`` (count, until), made if need be; None: every
        slot is at D. The caller holds the bucket's lock exclusive."""
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

    # --- the ledger: one region, its writers under one lock never waited on ---------------

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

    # --- the veto: a shard per worker, each written by its worker alone -------------------

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
