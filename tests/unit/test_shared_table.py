"""The ledger and the in-flight veto on the table worker processes share (``sidecar.release.shared``).

Each test maps the one file twice, as two workers do (or runs real processes
against it), and checks what one mapping sees of the other's writes. A worker
stopped inside an operation is one mapping holding a bucket's lock (shared
for a reader, exclusive for a writer); a worker killed inside a write is a
slot's writing flag left set with no lock held, or a real process killed
while it holds the lock. These run on x86_64 and, in ``make arm64``, on
aarch64; no duration is asserted under emulation (``tests.support.emulation``).
"""

from __future__ import annotations

import fcntl
import multiprocessing
import os
import signal
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from sidecar.app.shared import SharedInFlight
from sidecar.release.shared import SharedLedger, SharedTable
from sidecar.release.table import _BUCKET, _FLOCK, _SLOT, _digest
from tests.support.emulation import quick


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def tables(tmp_path: Path, clock: Clock) -> Iterator[tuple[SharedTable, SharedTable]]:
    path = tmp_path / "table"
    SharedTable.create(path, 1000, workers=4).close()
    one, two = SharedTable(path, clock), SharedTable(path, clock)
    yield one, two
    one.close()
    two.close()


def test_a_key_spent_through_one_mapping_is_a_duplicate_through_the_other(
    tables: tuple[SharedTable, SharedTable], clock: Clock
) -> None:
    first, second = SharedLedger(tables[0], 600.0), SharedLedger(tables[1], 600.0)
    assert first.add(("engine", "r1"))
    assert ("engine", "r1") in second
    assert not second.add(("engine", "r1"))
    assert ("engine", "r2") not in second and second.add(("engine", "r2"))
    assert len(first) == len(second) == 2
    clock.now += 601  # past the TTL: a new request may use them again
    assert ("engine", "r1") not in first
    assert second.add(("engine", "r1"))
    second.discard(("engine", "r1"))  # a job not sent: forgotten
    assert ("engine", "r1") not in first and first.add(("engine", "r1"))


def test_a_request_at_d_on_one_worker_vetoes_the_release_on_another(
    tables: tuple[SharedTable, SharedTable], clock: Clock
) -> None:
    zero, one = SharedInFlight(tables[0], 0, 30.0), SharedInFlight(tables[1], 1, 30.0)
    key = ("engine", "r1")
    zero.forwarded(key)
    zero.forwarded(key)
    assert one.may_be_read(key)
    zero.finished(key, admitted=False)
    assert one.may_be_read(key)  # the second copy is still at D
    zero.finished(key, admitted=False)
    assert not one.may_be_read(key)
    one.forwarded(key)
    one.finished(key, admitted=True)  # D admitted it: readable for the lease
    assert zero.may_be_read(key)
    clock.now += 31
    assert not zero.may_be_read(key)


def test_a_dead_workers_requests_at_d_stay_vetoed_for_the_lease(
    tables: tuple[SharedTable, SharedTable], clock: Clock
) -> None:
    dead, alive = SharedInFlight(tables[0], 3, 30.0), SharedInFlight(tables[1], 1, 30.0)
    dead.forwarded(("engine", "r1"))
    dead.forwarded(("engine", "r2"))
    alive.forwarded(("engine", "r3"))
    assert tables[1].reap(3, 30.0) == 2
    assert alive.may_be_read(("engine", "r1")) and alive.may_be_read(("engine", "r2"))
    alive.finished(("engine", "r3"), admitted=False)
    assert not alive.may_be_read(("engine", "r3"))
    clock.now += 31  # the lease over: D has let go of them
    assert not alive.may_be_read(("engine", "r1"))
    assert tables[1].reap(3, 30.0) == 0


def test_a_full_bucket_never_forgets_a_request_at_d(tmp_path: Path, clock: Clock) -> None:
    path = tmp_path / "tiny"
    SharedTable.create(path, 1, workers=1).close()  # 16 buckets of 8 slots
    table = SharedTable(path, clock)
    veto = SharedInFlight(table, 0, 30.0)
    keys = [("engine", f"r{i}") for i in range(400)]  # more than every slot: some bucket overflows
    for key in keys:
        veto.forwarded(key)
    assert all(veto.may_be_read(key) for key in keys)
    assert veto.may_be_read(("engine", "never-forwarded"))  # held: the veto cannot tell
    for key in keys:
        veto.finished(key, admitted=False)
    assert not veto.may_be_read(("engine", "never-forwarded"))  # all left D: nothing held
    ledger = SharedLedger(table, 600.0)
    assert all(ledger.add(key) for key in keys)  # spent entries evict one another, none at D
    table.close()


def _spend_all(path: str, keys: int, out: multiprocessing.Queue[int]) -> None:
    table = SharedTable(Path(path), patience=60.0)  # never gives up here: each key spent once
    ledger = SharedLedger(table, 600.0)
    out.put(sum(ledger.add(("engine", f"r{i}")) for i in range(keys)))


def test_two_processes_spending_the_same_keys_at_once_spend_each_once(tmp_path: Path) -> None:
    path = tmp_path / "table"
    SharedTable.create(path, 20_000).close()
    context = multiprocessing.get_context("spawn")
    out: multiprocessing.Queue[int] = context.Queue()
    workers = [context.Process(target=_spend_all, args=(str(path), 5000, out)) for _ in range(2)]
    for worker in workers:
        worker.start()
    counts = [out.get(timeout=120) for _ in workers]
    for worker in workers:
        worker.join(30)
    assert sum(counts) == 5000  # every key added exactly once across the two


def _half_written(table: SharedTable, base: int) -> None:
    """Leave the first slot of the bucket at ``base`` as a writer killed mid-write leaves it: its
    writing flag set (the kernel dropped the dead writer's lock)."""
    struct.pack_into("<I", table._map, base, 1)


def _hold(table: SharedTable, base: int, kind: int, length: int = _BUCKET) -> None:
    """``table``'s process stopped inside an operation: it holds the range at ``base``."""
    assert table._take(kind, base, length, 1.0)


def _other(key: tuple[str, str], where: Callable[[tuple[str, str]], int]) -> tuple[str, str]:
    """A key whose bucket (by ``where``) is not ``key``'s."""
    return next(k for i in range(100) if where(k := ("engine", f"other-{i}")) != where(key))


def _in_shard(table: SharedTable, worker: int) -> Callable[[tuple[str, str]], int]:
    """Where a key's bucket is in ``worker``'s shard."""
    return lambda key: table._shard(worker, _digest(key))


def _in_ledger(table: SharedTable) -> Callable[[tuple[str, str]], int]:
    """Where a key's bucket is in the ledger."""
    return lambda key: table._bucket(table._ledger, table._ledger_buckets, _digest(key))


def test_a_shard_half_written_by_a_dead_worker_vetoes_its_bucket_and_nothing_else(
    tables: tuple[SharedTable, SharedTable],
) -> None:
    stopped, alive = tables
    key = ("engine", "r1")
    bucket = _in_shard(stopped, 0)
    other = _other(key, bucket)
    _half_written(stopped, bucket(key))
    veto = SharedInFlight(alive, 1, 30.0)
    assert veto.may_be_read(key)  # it may be writing this key: no release
    assert not veto.may_be_read(other)
    veto.forwarded(other)  # its own shard: never waits
    assert veto.may_be_read(other)
    assert alive.reap(0, 30.0) == 1  # dead: the half-written slot is settled, every release held
    assert veto.may_be_read(("engine", "anything"))


def test_a_ledger_bucket_half_written_reads_as_spent_and_the_lock_is_never_waited_on(
    tables: tuple[SharedTable, SharedTable], clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    holder, waiter = tables
    ledger = SharedLedger(waiter, 600.0)
    key = ("engine", "r1")
    bucket = _in_ledger(holder)
    other = _other(key, bucket)
    assert holder._lock()
    _half_written(holder, bucket(key))  # a writer died mid-spend; the holder stopped in another
    assert key in ledger  # cannot tell: a replay is refused rather than reach D
    assert other not in ledger
    started = time.monotonic()
    assert not ledger.add(other)  # not recorded, so not released (P's lease frees the blocks)
    assert not ledger.add(("engine", "r3"))
    assert quick(time.monotonic() - started, 1.0)  # patience once (0.02 s), then not at all
    held = [r for r in caplog.records if "lock is held by a stopped or starved worker" in r.getMessage()]
    assert len(held) == 1  # said once, when it began
    ledger.discard(key)  # left spent
    assert key in ledger
    holder._unlock()
    assert ledger.add(other) and other in ledger  # the lock free again: recorded
    assert ledger.add(key)  # the next writer settled the half-written slot
    assert not ledger.add(key)
    clock.now += 601
    assert key not in ledger and other not in ledger


def test_a_worker_stopped_writing_its_shard_vetoes_that_bucket_at_once(
    tables: tuple[SharedTable, SharedTable],
) -> None:
    stopped, alive = tables
    key = ("engine", "r1")
    bucket = _in_shard(stopped, 0)
    other = _other(key, bucket)
    _hold(stopped, bucket(key), fcntl.F_WRLCK)  # inside a write, stopped: the lock never let go
    started = time.monotonic()
    veto = SharedInFlight(alive, 1, 30.0)
    assert veto.may_be_read(key)  # cannot be read: D may be reading it
    assert not veto.may_be_read(other)
    assert quick(time.monotonic() - started, 0.5)  # a read waits 2 ms, not on the writer
    stopped._drop(bucket(key), _BUCKET)
    assert not veto.may_be_read(key)


def test_a_reader_stopped_inside_a_workers_bucket_never_stalls_that_worker(
    tmp_path: Path, tables: tuple[SharedTable, SharedTable], clock: Clock
) -> None:
    reader, owner = tables
    third = SharedTable(tables[0].path, clock)
    key, unrelated = ("engine", "r1"), ("engine", "unrelated")
    _hold(reader, owner._shard(1, _digest(key)), fcntl.F_RDLCK)  # stopped inside may_be_read
    veto, judge = SharedInFlight(owner, 1, 30.0), SharedInFlight(third, 0, 30.0)
    started = time.monotonic()
    veto.forwarded(key)  # its bucket cannot be written: counted in the shard's header
    assert quick(time.monotonic() - started, 0.5)
    assert judge.may_be_read(key) and judge.may_be_read(unrelated)  # the header holds every release
    veto.finished(key, admitted=False)  # taken back from the header
    assert not judge.may_be_read(key) and not judge.may_be_read(unrelated)
    veto.forwarded(key)
    veto.forwarded(key)
    reader._drop(owner._shard(1, _digest(key)), _BUCKET)
    veto.finished(key, admitted=False)  # the header's two, one at a time
    assert judge.may_be_read(key)
    veto.finished(key, admitted=False)
    assert not judge.may_be_read(unrelated)

    # A request that reached the bucket, leaving D while a reader holds it: still at D until the
    # worker's next operation writes it.
    veto.forwarded(key)
    _hold(reader, owner._shard(1, _digest(key)), fcntl.F_RDLCK)
    started = time.monotonic()
    veto.finished(key, admitted=True)
    assert quick(time.monotonic() - started, 0.5)
    assert judge.may_be_read(key)
    reader._drop(owner._shard(1, _digest(key)), _BUCKET)
    veto.forwarded(unrelated)  # the next operation makes the write put off
    veto.finished(unrelated, admitted=False)
    assert judge.may_be_read(key)  # admitted for the lease now
    clock.now += 31
    assert not judge.may_be_read(key) and not judge.may_be_read(unrelated)
    third.close()


def test_a_reader_stopped_inside_a_ledger_bucket_costs_that_bucket_its_releases_only(
    tables: tuple[SharedTable, SharedTable],
) -> None:
    reader, writer = tables
    ledger = SharedLedger(writer, 600.0)
    key = ("engine", "r1")
    bucket = _in_ledger(writer)
    other = _other(key, bucket)
    _hold(reader, bucket(key), fcntl.F_RDLCK)
    started = time.monotonic()
    assert not ledger.add(key)  # not recorded, so not released: P's lease frees its blocks
    assert quick(time.monotonic() - started, 0.5)
    assert key not in ledger  # readers read beside the stopped one
    assert ledger.add(other) and other in ledger
    reader._drop(bucket(key), _BUCKET)
    assert ledger.add(key) and key in ledger


KILLED_WRITING = """
import fcntl, os, signal, struct, sys
from pathlib import Path
from sidecar.release.shared import SharedTable
from sidecar.release.table import _digest
table = SharedTable(Path(sys.argv[1]))
base = table._shard(0, _digest(("engine", "r1")))
assert table._take(fcntl.F_WRLCK, base, 256, 5.0)
struct.pack_into("<I", table._map, base, 1)
print("writing", flush=True)
os.kill(os.getpid(), signal.SIGSTOP)
"""


def test_a_worker_killed_inside_a_write_leaves_its_bucket_vetoed_until_reaped(
    tables: tuple[SharedTable, SharedTable], clock: Clock
) -> None:
    # A real process: the kernel drops its lock when it dies, and the flag tells what it left.
    _, alive = tables
    writer = subprocess.Popen([sys.executable, "-c", KILLED_WRITING, str(alive.path)], stdout=subprocess.PIPE)
    assert writer.stdout is not None and writer.stdout.readline() == b"writing\n"
    veto = SharedInFlight(alive, 1, 30.0)
    assert veto.may_be_read(("engine", "r1"))  # locked
    os.kill(writer.pid, signal.SIGKILL)
    writer.wait(30)
    writer.stdout.close()
    assert veto.may_be_read(("engine", "r1"))  # unlocked, half written
    base = alive._shard(0, _digest(("engine", "r1")))
    other = next(k for i in range(100) if alive._shard(0, _digest(k := ("engine", f"o-{i}"))) != base)
    assert not veto.may_be_read(other)
    assert alive.reap(0, 30.0) == 1
    assert veto.may_be_read(other)  # which key it was writing is unknown: every release held
    clock.now += 31
    assert not veto.may_be_read(("engine", "r1")) and not veto.may_be_read(other)


def test_every_slot_field_sits_where_the_readers_look() -> None:
    # The writing flag is a slot's first field (readers test its low byte), the digest its last.
    assert _SLOT.size == 32 and _SLOT.format == "<IId16s"


def test_the_lock_request_is_laid_out_as_the_kernel_reads_it(tables: tuple[SharedTable, SharedTable]) -> None:
    # struct flock as this machine's kernel lays it out (x86-64 and arm64 alike): a lock taken
    # through one mapping is the one another mapping's F_OFD_GETLK reports, range and kind.
    holder, asker = tables
    base = holder._shard(1, _digest(("engine", "r1")))
    _hold(holder, base, fcntl.F_WRLCK)
    question = _FLOCK.pack(fcntl.F_RDLCK, os.SEEK_SET, base, _BUCKET, 0)
    kind, _, start, length, pid = _FLOCK.unpack(fcntl.fcntl(asker._fd, fcntl.F_OFD_GETLK, question))
    assert (kind, start, length, pid) == (fcntl.F_WRLCK, base, _BUCKET, -1)  # OFD locks have no pid
    holder._drop(base, _BUCKET)
    kind, *_ = _FLOCK.unpack(fcntl.fcntl(asker._fd, fcntl.F_OFD_GETLK, question))
    assert kind == fcntl.F_UNLCK


def test_a_dead_workers_requests_in_its_header_are_held_for_the_lease_then_let_go(
    tables: tuple[SharedTable, SharedTable], clock: Clock
) -> None:
    reader, supervisor = tables
    dead = SharedTable(tables[0].path, clock)
    key, unrelated = ("engine", "r1"), ("engine", "unrelated")
    _hold(reader, dead._shard(3, _digest(key)), fcntl.F_RDLCK)
    SharedInFlight(dead, 3, 30.0).forwarded(key)  # counted in its header, then the worker died
    dead.close()
    reader._drop(supervisor._shard(3, _digest(key)), _BUCKET)
    veto = SharedInFlight(supervisor, 1, 30.0)
    assert veto.may_be_read(unrelated)
    assert supervisor.reap(3, 30.0) == 0  # none by key
    assert veto.may_be_read(unrelated)  # which keys is unknown: every release held for the lease
    clock.now += 31
    assert not veto.may_be_read(unrelated) and not veto.may_be_read(key)  # its count went with it
