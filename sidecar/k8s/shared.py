"""The supervisor's InferencePool lists, shared with its workers through one file (``workers``).

With several worker processes the pool is watched once per pod, by the
supervisor (``sidecar.server.workers``): one pool watch and one pod watch at
the API server, whatever the number of workers. Each time the watch's lists
change, ``Publisher`` writes them (router mode's P entries, the release
entries, whether the pool and its pods are listed) with a version one higher
to ``pool-lists.json`` in the supervisor's private directory in shared memory
(``sidecar.server.scratch``): into a file of its own first, then renamed over
the last one, so a reader opens the old file or the new one, never one half
written. Each worker (``Follower``) reads it when it starts, so a restarted
worker enforces the current lists at once, then stats it every
``POLL_SECONDS`` and reads it again only when it is another file (another
inode, mtime or size), taking it only when its version is higher. No lock:
the writer never waits on a reader, nor a reader on the writer. A file
missing, unreadable or torn, or a version going backwards, leaves a worker's
lists as they are (logged once): as a failing watch leaves a single
process's lists as last listed while it lists again. Each worker adds
``prefill_allow`` to the entries itself (``LiveAllowlist``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from pathlib import Path

import msgspec

from sidecar.k8s.members import LiveAllowlist, first_list
from sidecar.network.allowlist import parse_entry

log = logging.getLogger("sidecar.k8s")

FILE = "pool-lists.json"
POLL_SECONDS = 0.1  # a worker stats the file this often: a change reaches it within that much


class PoolLists(msgspec.Struct, frozen=True, kw_only=True):
    """One version of the watch's lists, as written to the file."""

    version: int
    synced: bool  # the pool, and the pods it selects, were listed (``Watch.synced``)
    prefill: tuple[str, ...] = ()  # router mode: each pod IP on each target port
    release: tuple[str, ...] = ()  # the NIXL targets: each pod IP on the side-channel ports


_decoder = msgspec.json.Decoder(PoolLists)


class Publisher:
    """Writes each new version of the lists (the supervisor's watch calls ``publish``)."""

    def __init__(self, path: Path) -> None:
        self.path, self.version = path, 0
        self._last: tuple[tuple[str, ...], tuple[str, ...], bool] | None = None

    def publish(self, prefill: list[str], release: list[str], synced: bool) -> None:
        """Write the lists unless they are the ones last written (a pod's status changed, not its IPs).
        A failed write is logged and made again at the watch's next event."""
        lists = (tuple(prefill), tuple(release), synced)
        if lists == self._last:
            return
        body = PoolLists(version=self.version + 1, synced=synced, prefill=lists[0], release=lists[1])
        try:
            write(self.path, msgspec.json.encode(body))
        except OSError as exc:
            log.error(
                "cannot write the InferencePool lists for the workers; they keep the lists last written",
                extra={"path": str(self.path), "detail": str(exc)},
            )
            return
        self.version, self._last = body.version, lists


def write(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` at once: written beside it, then renamed over it."""
    new = path.with_name(path.name + ".new")
    fd = os.open(new, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)
    os.replace(new, path)


class Reader:
    """The newest lists in the file, read only when it changed (see the module docstring)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.current: PoolLists | None = None
        self._seen: tuple[int, int, int] | None = None  # the file last read: inode, mtime, size
        self._warned: str | None = None

    def read(self) -> PoolLists | None:
        """The lists, when the file holds a higher version than the last taken; else None."""
        try:
            stat = os.stat(self.path)
        except FileNotFoundError:
            return None  # not written yet: the pool is still being listed
        except OSError as exc:
            self._warn("cannot read the InferencePool lists; keeping the last ones", exc)
            return None
        seen = (stat.st_ino, stat.st_mtime_ns, stat.st_size)
        if seen == self._seen:
            return None
        self._seen = seen
        try:
            lists = _decoder.decode(self.path.read_bytes())
            for entry in (*lists.prefill, *lists.release):
                parse_entry(entry)
        except (OSError, msgspec.DecodeError, ValueError) as exc:
            self._warn("unreadable InferencePool lists; keeping the last ones", exc)
            return None
        if self.current is not None and lists.version <= self.current.version:
            if lists.version < self.current.version:
                self._warn("InferencePool lists went back a version; keeping the newer", lists.version)
            return None
        self.current, self._warned = lists, None
        return lists

    def _warn(self, message: str, detail: object) -> None:
        if self._warned != message:  # once until lists are taken again
            log.warning(message, extra={"path": str(self.path), "detail": str(detail)})
            self._warned = message


class Follower:
    """A worker's ``PoolWatch``: ``prefill`` and ``release`` kept equal to the supervisor's lists."""

    def __init__(
        self, path: Path, prefill: LiveAllowlist, release: LiveAllowlist, interval: float = POLL_SECONDS
    ) -> None:
        self._reader, self._lists, self._interval = Reader(path), (prefill, release), interval
        self._first = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    @property
    def synced(self) -> bool:
        """The supervisor's watch had listed the pool, and its pods, when it last wrote."""
        return self._reader.current is not None and self._reader.current.synced

    def launch(self) -> None:
        """Take the lists written so far at once, then follow them on a task of its own."""
        self.poll()
        self._task = asyncio.create_task(self._follow())

    def poll(self) -> None:
        lists = self._reader.read()
        if lists is None:
            return
        self._lists[0].replace(list(lists.prefill))
        self._lists[1].replace(list(lists.release))
        if lists.synced:
            self._first.set()
        log.debug("InferencePool lists taken", extra={"version": lists.version, "prefill": lists.prefill})

    async def _follow(self) -> None:
        while True:
            await asyncio.sleep(self._interval)
            try:
                self.poll()
            except Exception:  # a bug here must not stop the following: the lists would freeze
                log.exception("following the InferencePool lists failed; trying again")

    async def first_list(self, wait: float) -> None:
        await first_list(self._first, wait, lambda: self.synced)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
