"""``python -m tests.faults.sidecar_proc --debug-port N <serve flags>``: the sidecar with a debug port.

Runs exactly what ``kv-release-sidecar serve`` runs (``sidecar.server.serve.serve``,
same flags, same logging set-up, uvloop) and, on the same event loop, a tiny
HTTP endpoint ``GET /debug`` on 127.0.0.1:``N`` answering the number of asyncio
tasks on the sidecar's loop (with their names) and the sizes of the internal
structures the metrics do not show (``tests.faults.evidence.ProcessView``).
The soak measures the child's RSS from ``/proc``; this port gives it what only
the process itself can see. ``create_app`` is wrapped to keep a reference to
the app ``serve`` builds; nothing else differs from production.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from sidecar import config as config_mod
from sidecar.app import Deps, ProxyApp, create_app
from sidecar.config import args as config_args
from sidecar.observability import logs
from sidecar.server import serve as serve_mod
from tests.faults.cluster import VERSION
from tests.faults.evidence import Bounds, ProcessView
from tests.faults.taskkind import task_kind
from tests.support.runner import sidecar_process


def _internals(app: ProxyApp | None) -> dict[str, int]:
    runtime = app.runtime if app is not None else None
    if runtime is None:
        return {}
    releaser: Any = runtime.releaser
    return {
        "queue": runtime.pipeline.depth,
        "progress": len(getattr(releaser, "_progress", ())),
        "handshakes_in_flight": len(getattr(getattr(releaser, "session", None), "pending", ())),
        "inflight_live": len(runtime.inflight._live),
        "inflight_admitted": len(runtime.inflight._admitted),
        "live_jobs": runtime.pipeline.live,
        "targets": len(runtime.pipeline.targets),
    }


async def _debug(apps: list[ProxyApp], reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while (await reader.readline()) not in (b"\r\n", b"\n", b""):
            pass
        current = asyncio.current_task()
        tasks = [task for task in asyncio.all_tasks() if task is not current]
        body = json.dumps(
            {
                "tasks": len(tasks),
                "task_names": sorted(task_kind(task) for task in tasks),
                "internals": _internals(apps[0] if apps else None),
            }
        ).encode()
        head = f"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
        writer.write(head.encode() + b"connection: close\r\n\r\n" + body)
        await writer.drain()
    finally:
        writer.close()


async def _main(config: config_mod.Config, debug_port: int) -> None:
    apps: list[ProxyApp] = []
    original = create_app

    def keep(config: config_mod.Config, deps: Deps | None = None) -> ProxyApp:
        app = original(config, deps)
        apps.append(app)
        return app

    serve_mod.create_app = keep  # type: ignore[attr-defined]  # the name serve() calls
    server = await asyncio.start_server(lambda r, w: _debug(apps, r, w), "127.0.0.1", debug_port)
    try:
        await serve_mod.serve(config)
    finally:
        server.close()


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="sidecar_proc")
    parser.add_argument("--debug-port", dest="_debug_port", type=int, required=True)
    serve_mod.add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        config = config_args.load(args)[0]
    except config_mod.ConfigError as exc:
        print(f"sidecar_proc: {exc}", file=sys.stderr)
        return 2
    logs.setup(config.log_level, config.log_format)
    import uvloop

    uvloop.install()
    asyncio.run(_main(config, args._debug_port))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))


DRAIN, FLUSH, DELAY = 10.0, 3.0, 0.3


@dataclass
class Child:
    proc: subprocess.Popen[bytes]
    url: str
    admin: str
    log: Path

    def view(self) -> ProcessView:
        bounds = Bounds(queue=4096, ledger=65536, engines=256, release_ambiguous=False, release_deadline=30)
        return ProcessView(self.admin, "", self.log, bounds)


@contextmanager
def child_sidecar(decode_url: str, *flags: str) -> Iterator[Child]:
    """The sidecar as a child process releasing over NIXL, its log (JSON, info) kept for the
    scenario to read; ready once its admin port says so."""
    settings = ["--release", "nixl", "--vllm-version", VERSION, "--prefill-allow", "127.0.0.1"]
    settings += ["--handshake-timeout", "0.5", "--release-retry-max", "0.2"]
    settings += ["--log-format", "json", "--log-level", "info", "--shutdown-delay", str(DELAY)]
    settings += ["--drain-timeout", str(DRAIN), "--flush-timeout", str(FLUSH)]
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "sidecar.log"
        with sidecar_process(decode_url, *settings, *flags, log=log, ready="/readyz", timeout=30) as started:
            proc, url, admin = started
            yield Child(proc, url, admin, log)


def _status(url: str) -> int:
    try:
        return httpx.get(url, timeout=1).status_code
    except httpx.TransportError:
        return 0
