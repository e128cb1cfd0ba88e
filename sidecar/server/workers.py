"""``workers``: N serving processes on the same ports, under one supervisor.

With ``workers`` above 1, ``serve`` binds every port as before and becomes the
supervisor: it starts N worker processes (``python -m sidecar.server.worker``)
that inherit the proxy port's listening sockets, and serves the admin port
itself (``sidecar.app.fleet``). Each worker is a whole sidecar (its own event
loop, pool to D, release pipeline and, with ``--release nixl``, its own NIXL
agent) whose spent-parameters ledger and in-flight veto live in one table in
shared memory (``sidecar.release.shared``), so a replay is refused and a
release vetoed whichever worker the connection reached.

Inherited sockets rather than ``SO_REUSEPORT``: the ports are bound once, by
the supervisor, so a port in use is one clear error before any worker starts
and port 0 means one port; every worker takes connections from the one accept
queue, so a connection never waits behind a busy or dead worker (with
``SO_REUSEPORT`` the kernel hashes each connection to one listener at its SYN,
whatever that worker's load, and the connections queued on a dead worker's
listener are reset); and a restarted worker needs no bind, so no window where
the port is missing a listener.

SIGTERM (or SIGINT): the admin port's ``/readyz`` turns 503, every worker gets
SIGTERM and drains and flushes its releases as one sidecar does, the
supervisor waits for them (bounded by ``shutdown_delay + drain_timeout +
flush_timeout`` and a margin, then SIGKILL), and exits. A worker that exits
otherwise is logged and restarted (after a second if it lived less than
that); its requests at D stay vetoed for the lease (``SharedTable.reap``) and
nothing is released for them: the dead worker cannot, and no other worker
judged them. A worker whose start-up fails the first time (an unreadable
token file, say) stops the supervisor, which exits 1 as one process does.
The table and the workers' admin sockets live in a private directory in
shared memory; at its start a supervisor removes those that supervisors
killed outright left behind (``sidecar.server.scratch``). With an
InferencePool the supervisor watches it, once for the pod, and writes its
lists into that directory for the workers to follow (``sidecar.k8s.shared``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import shutil
import signal
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
from prometheus_client import CollectorRegistry, Counter, Gauge

from sidecar.app.fleet import Fleet, Member, Totals, create_fleet_admin_app
from sidecar.config import Config
from sidecar.config.rules import MAX_WORKERS
from sidecar.k8s import PoolWatch, publishing_watch
from sidecar.k8s.shared import FILE as POOL_LISTS
from sidecar.release.shared import SharedTable
from sidecar.server import scratch
from sidecar.server.host import Server, serve_tls, uvicorn_config
from sidecar.server.limits import ServerLimits
from sidecar.tls.server import ServerTLS

log = logging.getLogger("sidecar.serve")

RESTART_BACKOFF = 1.0
STOP_MARGIN = 10.0
# A worker's exit status when its lifespan failed to start (1 would be any unhandled error, which
# is restarted); the supervisor then exits 1, as one process does.
STARTUP_FAILED = 3


def count(setting: str, cgroup: Path = Path("/sys/fs/cgroup")) -> int:
    """Worker processes for ``setting``: a number, or ``auto``: the cores of the container's CPU
    quota (cgroup v2 ``cpu.max``, or v1 ``cpu.cfs_quota_us``), at most the CPUs this process may
    run on, at least 1."""
    if setting != "auto":
        return int(setting)
    cpus = len(os.sched_getaffinity(0))
    quota = _quota(cgroup)
    return max(1, min(MAX_WORKERS, cpus, math.ceil(quota) if quota else cpus))


def _quota(cgroup: Path) -> float | None:
    """The CPU quota in cores, None when there is none."""
    with contextlib.suppress(OSError, ValueError):
        limit, period = (cgroup / "cpu.max").read_text().split()[:2]
        return None if limit == "max" else int(limit) / int(period)
    for folder in ("cpu", "cpu,cpuacct"):
        with contextlib.suppress(OSError, ValueError):
            quota = int((cgroup / folder / "cpu.cfs_quota_us").read_text())
            length = int((cgroup / folder / "cpu.cfs_period_us").read_text())
            return None if quota <= 0 else quota / length
    return None


class WorkerSpec(msgspec.Struct, frozen=True, kw_only=True):
    """What a worker is told on its standard input."""

    config: Config
    index: int
    table: str  # the shared table's file
    admin_socket: str  # where it serves its admin app
    sockets: dict[str, list[int]]  # inherited listening sockets by setting (port, port+1, ...)
    pool_lists: str = ""  # the supervisor's InferencePool lists (``sidecar.k8s.shared``); "": no pool


@dataclass
class _Slot:
    index: int
    admin_socket: str
    process: asyncio.subprocess.Process | None = None
    started_at: float = 0.0
    starts: int = 0
    alive: bool = False
    watcher: asyncio.Task[None] | None = field(default=None, repr=False)


class Supervisor(Fleet):
    """Starts, watches, restarts and stops the workers; serves the admin port."""

    def __init__(
        self, config: Config, sockets: dict[str, list[socket.socket]], size: int, admin_tls: ServerTLS | None
    ) -> None:
        self.config, self.size, self.draining, self.totals = config, size, False, Totals()
        self._sockets, self._admin_tls = sockets, admin_tls
        scratch.sweep(parent := scratch.shm())
        self._dir, self._owner = scratch.make(parent)
        self.table = SharedTable.create(self._dir / "ledger", 2 * config.ledger_size, size)
        self._slots = [_Slot(i, str(self._dir / f"worker-{i}.sock")) for i in range(size)]
        self._pool_lists = self._dir / POOL_LISTS if config.inference_pool else None
        self._pool: PoolWatch | None = None
        self._stop = asyncio.Event()
        self.failed = 0
        self.registry = CollectorRegistry()
        self._running = Gauge("kvr_workers", "Worker processes running.", registry=self.registry)
        self._restarts = Counter(
            "kvr_worker_restarts", "Workers restarted after they exited.", ["worker"], registry=self.registry
        )

    def members(self) -> list[Member]:
        return [
            Member(s.index, s.process.pid if s.process else 0, s.admin_socket, s.alive) for s in self._slots
        ]

    def _inherited(self) -> dict[str, list[int]]:
        return {k: [s.fileno() for s in v] for k, v in self._sockets.items() if k != "admin_port"}

    async def _spawn(self, slot: _Slot) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(slot.admin_socket)
        inherited = self._inherited()
        spec = WorkerSpec(
            config=self.config, index=slot.index, table=str(self.table.path),
            admin_socket=slot.admin_socket, sockets=inherited, pool_lists=str(self._pool_lists or ""),
        )  # fmt: skip
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "sidecar.server.worker", stdin=asyncio.subprocess.PIPE,
            pass_fds=[fd for fds in inherited.values() for fd in fds],
        )  # fmt: skip
        assert process.stdin is not None
        process.stdin.write(msgspec.json.encode(spec))  # the config holds secrets: not in argv or env
        await process.stdin.drain()
        process.stdin.close()
        slot.process, slot.started_at, slot.alive = process, time.monotonic(), True
        slot.starts += 1
        self._running.inc()
        log.info("worker started", extra={"worker": slot.index, "pid": process.pid})

    async def _watch(self, slot: _Slot) -> None:
        while slot.process is not None:
            code = await slot.process.wait()
            slot.alive = False
            self._running.dec()
            if self.draining:
                return
            if slot.starts == 1 and code == STARTUP_FAILED:
                log.error("worker failed to start", extra={"worker": slot.index, "returncode": code})
                self.failed = 1
                self._stop.set()
                return
            # In a thread: resetting its shard's header waits while a stopped worker holds it
            # (reading every header); no request waits on that, and the event loop serves on.
            vetoed = await asyncio.to_thread(self._settle, slot.index)
            self.totals.retire(slot.index)
            log.error(
                "worker exited; restarting it (its requests at D are not released)",
                extra={"worker": slot.index, "pid": slot.process.pid, "returncode": code, "vetoed": vetoed},
            )
            if time.monotonic() - slot.started_at < RESTART_BACKOFF:
                await asyncio.sleep(RESTART_BACKOFF)  # a crash loop restarts once a second at most
            self._restarts.labels(str(slot.index)).inc()
            await self._spawn(slot)

    def _settle(self, index: int) -> int:
        """A dead worker's part of the table: its requests at D vetoed for the lease, and a ledger
        slot it may have died writing settled; how many keys it had at D."""
        vetoed = self.table.reap(index, self.config.release_deadline)
        self.table.repair(self.config.ledger_ttl)
        return vetoed

    async def run(self) -> int:
        """Serve until SIGTERM or SIGINT; the exit status."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stop.set)
        config = self.config
        if self._pool_lists is not None:  # one watch for the pod, before any worker: they follow it
            try:
                self._pool = publishing_watch(config, self._pool_lists)
            except Exception:
                log.exception("start-up failed: the InferencePool watch")
                self._remove()
                return 1
        admin = Server(
            uvicorn_config(
                create_fleet_admin_app(self), config.admin_host, config.admin_port,
                ServerLimits.of(config, admin=True), lifespan="off",
            )
        )  # fmt: skip
        serve_tls(admin.config, self._admin_tls)
        admin_task = asyncio.create_task(admin.serve(sockets=self._sockets["admin_port"]))
        tls = self._admin_tls
        reload = asyncio.create_task(tls.watch()) if tls is not None and tls.cert_dir else None
        try:
            for slot in self._slots:
                await self._spawn(slot)
                slot.watcher = asyncio.create_task(self._watch(slot))
            pids, where = [m.pid for m in self.members()], str(self._dir)
            log.info("workers started", extra={"workers": self.size, "pids": pids, "directory": where})
            await self._stop.wait()
            await self._drain()
        finally:
            admin.should_exit = True
            await asyncio.gather(admin_task, return_exceptions=True)
            if reload is not None:
                reload.cancel()
            if self._pool is not None:
                await self._pool.close()
            self._remove()
        return self.failed

    def _remove(self) -> None:
        """Close the table and remove the private directory."""
        self.table.close()
        shutil.rmtree(self._dir, ignore_errors=True)
        os.close(self._owner)

    async def _drain(self) -> None:
        self.draining = True
        log.info("shutting down: readiness off, every worker draining")
        for name, socks in self._sockets.items():
            if name != "admin_port":  # no worker starts again: once the workers close theirs, the
                for sock in socks:  # port refuses new connections, as one process's does
                    sock.close()
        running = [s for s in self._slots if s.process is not None and s.process.returncode is None]
        for slot in running:
            assert slot.process is not None
            with contextlib.suppress(ProcessLookupError):
                slot.process.send_signal(signal.SIGTERM)
        config = self.config
        bound = config.shutdown_delay + config.drain_timeout + config.flush_timeout + STOP_MARGIN
        waits = [asyncio.create_task(s.process.wait()) for s in running if s.process is not None]
        if waits:
            await asyncio.wait(waits, timeout=bound)
        for slot in running:
            assert slot.process is not None
            if slot.process.returncode is None:
                log.error("worker did not stop in time; killed", extra={"worker": slot.index})
                with contextlib.suppress(ProcessLookupError):
                    slot.process.kill()
                await slot.process.wait()
        for slot in self._slots:
            if slot.watcher is not None:
                slot.watcher.cancel()
        codes = [s.process.returncode for s in running if s.process is not None]
        log.info("workers stopped", extra={"returncodes": codes})


def supervise(
    config: Config, sockets: dict[str, list[socket.socket]], size: int, admin_tls: ServerTLS | None
) -> int:
    """Run ``size`` workers on ``sockets`` until SIGTERM; the exit status."""

    async def main() -> int:
        return await Supervisor(config, sockets, size, admin_tls).run()

    return asyncio.run(main())
