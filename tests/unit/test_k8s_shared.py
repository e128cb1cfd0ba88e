"""The supervisor's InferencePool lists in a file, and the workers that follow it (``sidecar.k8s.shared``).

Real files in a temporary directory: the supervisor's ``Publisher`` writes,
a worker's ``Reader``/``Follower`` reads. A file missing, torn or not the
format, or a version lower than the one taken, changes nothing a worker
enforces; a file whose inode, mtime and size are unchanged is not read again.
"""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from sidecar.k8s.members import LiveAllowlist
from sidecar.k8s.shared import FILE, Follower, PoolLists, Publisher, Reader, write

PREFILL, RELEASE = ["10.0.0.1:8000"], ["10.0.0.1:5600-5663"]


def lists(version: int, synced: bool = True, prefill: list[str] = PREFILL) -> bytes:
    return msgspec.json.encode(PoolLists(version=version, synced=synced, prefill=tuple(prefill), release=()))


def test_each_change_is_a_higher_version_and_an_unchanged_one_is_not_written(tmp_path: Path) -> None:
    path = tmp_path / FILE
    publisher, reader = Publisher(path), Reader(path)
    publisher.publish(PREFILL, RELEASE, False)
    first = reader.read()
    assert first == PoolLists(version=1, synced=False, prefill=tuple(PREFILL), release=tuple(RELEASE))
    inode = path.stat().st_ino
    publisher.publish(PREFILL, RELEASE, False)  # a pod's status changed, not its IPs
    assert path.stat().st_ino == inode and reader.read() is None and publisher.version == 1
    publisher.publish(PREFILL, RELEASE, True)
    assert reader.read() == PoolLists(version=2, synced=True, prefill=tuple(PREFILL), release=tuple(RELEASE))
    assert reader.read() is None  # nothing new
    assert sorted(p.name for p in tmp_path.iterdir()) == [FILE]  # the file beside it was renamed over it


def test_a_missing_file_is_nothing_yet_then_read_once_written(tmp_path: Path) -> None:
    reader = Reader(tmp_path / FILE)
    assert reader.read() is None and reader.current is None
    write(tmp_path / FILE, lists(1))
    assert reader.read() == PoolLists(version=1, synced=True, prefill=tuple(PREFILL))
    (tmp_path / FILE).unlink()  # the directory removed under a worker: it keeps what it has
    assert reader.read() is None and reader.current is not None and reader.current.version == 1


@pytest.mark.parametrize(
    "content",
    [
        lists(2)[:-7],  # torn: cut in the middle
        b"",
        b'{"version": "2", "synced": true}',  # not the format
        lists(2, prefill=["10.0.0.1:99999"]),  # an entry no allowlist takes
    ],
    ids=["torn", "empty", "wrong-type", "bad-entry"],
)
def test_an_unreadable_file_keeps_the_lists_taken_and_warns_once(
    tmp_path: Path, content: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / FILE
    reader = Reader(path)
    write(path, lists(1))
    assert reader.read() is not None
    path.write_bytes(content)  # in place, as a writer that did not rename would leave it
    os.utime(path, ns=(1, 1))
    with caplog.at_level(logging.WARNING, "sidecar.k8s"):
        assert reader.read() is None
        os.utime(path, ns=(2, 2))  # looked at again: still unreadable, not logged again
        assert reader.read() is None
    assert reader.current is not None and reader.current.version == 1
    assert [r.message for r in caplog.records] == ["unreadable InferencePool lists; keeping the last ones"]
    write(path, lists(2, prefill=["10.0.0.2:8000"]))
    assert reader.read() == PoolLists(version=2, synced=True, prefill=("10.0.0.2:8000",))


def test_a_version_going_backwards_or_repeated_is_not_taken(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / FILE
    reader = Reader(path)
    write(path, lists(5))
    assert reader.read() is not None
    with caplog.at_level(logging.WARNING, "sidecar.k8s"):
        write(path, lists(4, prefill=[]))
        assert reader.read() is None
        write(path, lists(5, prefill=[]))  # the same version with other lists: not taken either
        assert reader.read() is None
    assert reader.current == PoolLists(version=5, synced=True, prefill=tuple(PREFILL))
    backwards = "InferencePool lists went back a version; keeping the newer"
    assert [r.message for r in caplog.records] == [backwards]
    write(path, lists(6, prefill=[]))
    assert reader.read() == PoolLists(version=6, synced=True)


def test_a_file_whose_inode_mtime_and_size_are_unchanged_is_not_read_again(tmp_path: Path) -> None:
    path = tmp_path / FILE
    reader = Reader(path)
    write(path, lists(1))
    assert reader.read() is not None
    stat = path.stat()
    path.write_bytes(lists(2))  # in place: same inode, same size, its mtime put back
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert reader.read() is None and reader.current is not None and reader.current.version == 1
    os.utime(path)  # once the file is another by its stat, it is read
    assert reader.read() is not None and reader.current.version == 2


def test_a_failed_write_is_logged_and_made_at_the_next_change(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "gone" / FILE
    publisher = Publisher(path)
    with caplog.at_level(logging.ERROR, "sidecar.k8s"):
        publisher.publish(PREFILL, RELEASE, True)
    assert publisher.version == 0 and "cannot write the InferencePool lists" in caplog.text
    path.parent.mkdir()
    publisher.publish(PREFILL, RELEASE, True)  # the same lists: not yet written, so written now
    written = PoolLists(version=1, synced=True, prefill=tuple(PREFILL), release=tuple(RELEASE))
    assert Reader(path).read() == written


async def test_a_follower_takes_the_lists_written_at_once_then_each_change(tmp_path: Path) -> None:
    path = tmp_path / FILE
    publisher = Publisher(path)
    publisher.publish(PREFILL, RELEASE, True)
    prefill, release = LiveAllowlist(["10.9.9.9"]), LiveAllowlist(["10.9.9.9"])
    follower = Follower(path, prefill, release, interval=0.01)
    follower.launch()
    try:
        # At once, before the event loop runs anything: a restarted worker serves the current lists.
        assert follower.synced and prefill.allows("10.0.0.1", 8000) and release.allows("10.0.0.1", 5600)
        assert not prefill.allows("10.0.0.1", 5600) and prefill.allows("10.9.9.9", 1)  # prefill_allow stays
        await asyncio.wait_for(follower.first_list(5.0), 0.5)
        publisher.publish(["10.0.0.2:8000"], ["10.0.0.2:5600-5663"], False)  # a new selector, pods relisted
        async with asyncio.timeout(5):
            while follower.synced:  # noqa: ASYNC110 - the follower polls; it offers no event for a change
                await asyncio.sleep(0.01)
        assert prefill.allows("10.0.0.2", 8000) and not prefill.allows("10.0.0.1", 8000)
        assert release.allows("10.0.0.2", 5663) and not release.allows("10.0.0.1", 5600)
    finally:
        await follower.close()


async def test_a_follower_with_no_lists_yet_is_not_synced_and_allows_only_prefill_allow(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    prefill, release = LiveAllowlist(["10.9.9.9:8000"]), LiveAllowlist(())
    follower = Follower(tmp_path / FILE, prefill, release, interval=0.01)
    follower.launch()
    try:
        with caplog.at_level(logging.WARNING, "sidecar.k8s"):
            await follower.first_list(0.05)
        assert not follower.synced and "InferencePool not listed yet" in caplog.text
        assert prefill.allows("10.9.9.9", 8000) and not release.allows("10.9.9.9", 5600)
        Publisher(tmp_path / FILE).publish(PREFILL, RELEASE, True)
        await asyncio.wait_for(follower.first_list(5.0), 1.0)
        assert follower.synced and release.allows("10.0.0.1", 5600)
    finally:
        await follower.close()


def test_the_supervisor_and_its_workers_import_no_kubernetes_client_without_a_pool() -> None:
    code = (
        "import sys; import sidecar.server.workers, sidecar.server.worker, sidecar.app.core; "
        "print(sorted(m for m in sys.modules if m.startswith('lightkube')))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"
