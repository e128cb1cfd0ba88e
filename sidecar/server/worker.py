"""``python -m sidecar.server.worker``: one worker process of ``workers`` (``sidecar.server.workers``).

Reads its ``WorkerSpec`` from standard input, takes the listening sockets it
inherited, serves its admin app on its Unix socket, and runs ``serve`` as one
sidecar does, its ledger and veto on the shared table. It gets SIGTERM if the
supervisor dies, so no worker outlives it.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import signal
import socket
import sys
from pathlib import Path

import msgspec

from sidecar.app import Deps, Worker
from sidecar.observability import logs
from sidecar.proxy.trust import Trust
from sidecar.release.shared import SharedTable
from sidecar.server import memory, scratch
from sidecar.server.accept import Acceptor
from sidecar.server.serve import Serving, StartupFailed, preflight, raise_file_limit, serve
from sidecar.server.workers import STARTUP_FAILED, WorkerSpec

PR_SET_PDEATHSIG = 1
# Every worker reads the one accept queue, and the kernel wakes each of them when it fills: each
# takes at most this many per wake-up, so a burst is spread over the workers awake rather than
# taken whole by the first (a busier worker comes back to the queue later, and so takes fewer).
SHARED_QUEUE_BATCH = 64


def _die_with_parent() -> None:
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


class _Worker(logging.Filter):
    """Every log line of this process names its worker (``worker``), unless it names one itself."""

    def __init__(self, index: int) -> None:
        super().__init__()
        self.index = index

    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "worker"):
            record.worker = self.index
        return True


def main() -> int:
    _die_with_parent()
    Acceptor.batch = SHARED_QUEUE_BATCH
    spec = msgspec.json.decode(sys.stdin.buffer.read(), type=WorkerSpec)
    config = spec.config
    sockets = {name: [socket.socket(fileno=fd) for fd in fds] for name, fds in spec.sockets.items()}
    admin = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    admin.bind(spec.admin_socket)
    admin.listen(64)
    sockets["admin_port"] = [admin]
    logs.setup(config.log_level, config.log_format, config.access_log)
    for handler in logging.getLogger().handlers:
        handler.addFilter(_Worker(spec.index))
    memory.release_large_buffers()
    raise_file_limit(config.pool_size)
    trust = Trust(config)
    tls = preflight(config)
    with contextlib.suppress(ImportError):
        import uvloop

        uvloop.install()
    scratch.hold(Path(spec.table).parent)  # held until this process ends: the directory is in use
    table = SharedTable(Path(spec.table))
    pool_lists = Path(spec.pool_lists) if spec.pool_lists else None
    deps = Deps(trust=trust, shared=Worker(spec.index, table, pool_lists))
    try:
        asyncio.run(serve(config, sockets=sockets, deps=deps, tls=Serving(tls.proxy, None)))
    except StartupFailed as exc:
        print(f"kv-release-sidecar worker {spec.index}: {exc}", file=sys.stderr)
        return STARTUP_FAILED
    finally:
        table.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
