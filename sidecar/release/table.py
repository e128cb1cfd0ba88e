"""The shared table's file: its layout, its byte-range locks and its slots (``sidecar.release.shared``).

The file the supervisor creates and every worker maps: a header, one slot per
worker's shard header, the ledger's buckets, then each worker's shard of the
veto; a bucket is 8 slots of 32 bytes, a key's bucket picked by its 16-byte
BLAKE2b digest. Every bucket is read under a shared and written under an
exclusive Linux open-file-description lock on its byte range, tried without
blocking for a bounded time; why that is right on every CPU is in
``sidecar.release.shared``.
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
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import Self

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


class Table:
    """The mapped file; ``create`` once (the supervisor), ``open`` in each worker. The threads of
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

    @classmethod
    def create(cls, path: Path, entries: int, workers: int = MAX_WORKERS) -> Self:
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
        if _SLOT.unpack_from(bucket, best)[2] > 0:
            self._dropped(base)
        return base + best, 0, 0.0

    def _dropped(self, base: int) -> None:
        """An entry of the bucket at ``base`` (expired, or expiring first) gave its slot to another key."""
