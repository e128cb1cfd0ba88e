"""``kv-release-sidecar demo``: the sidecar in front of the fake decode server.

Starts, on loopback ephemeral ports and in one process, the decode simulator
and the sidecar (``--release dry-run`` by default), drives a handful of P/D
decode requests (some admitted, some rejected by D for realistic reasons,
one while D is down) and prints, for each, D's answer and what the sidecar
released. Exits 0 when every request got the release decision it should.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import sys
import time
from dataclasses import dataclass
from typing import Any, Literal

import httpx
import uvicorn

from sidecar import logs
from sidecar.app import Deps, ProxyApp, create_admin_app, create_app
from sidecar.config import Config
from sidecar.release.dryrun import DryRunReleaser
from sidecar.sim.decode import create_decode_app
from sidecar.sim.decode_config import DecodeSimConfig


@dataclass(frozen=True)
class Case:
    name: str
    body: dict[str, Any]
    route: str = "/v1/chat/completions"
    expect_release: bool = False


def _params(request_id: str) -> dict[str, Any]:
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": "prefill-engine-0",
        "remote_request_id": request_id,
        "remote_host": "10.0.0.7",
        "remote_port": 5600,
        "remote_block_ids": [[1, 2, 3, 4]],
        "tp_size": 2,
    }


def _chat(text: str, **extra: Any) -> dict[str, Any]:
    return {"model": "sim-model", "messages": [{"role": "user", "content": text}], "max_tokens": 8, **extra}


CASES = [
    Case("admitted", _chat("hello there")),
    Case("admitted, streaming", _chat("tell me a story", stream=True)),
    Case("prompt over max_model_len", _chat("word " * 5000), expect_release=True),
    Case("unknown model", {**_chat("hi"), "model": "no-such-model"}, expect_release=True),
    Case("D overloaded (503)", _chat("hi [[reject:503]]"), expect_release=True),
    Case(
        "stream admission failure (200 + SSE error)",
        _chat("hi [[stream-error:400]]", stream=True),
        expect_release=True,
    ),
    Case(
        "completions, invalid max_tokens",
        {"model": "sim-model", "prompt": "hi", "max_tokens": -1},
        "/v1/completions",
        True,
    ),
    Case("no kv_transfer_params (not P/D)", _chat("hello")),
]


def _socket() -> socket.socket:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(256)
    return sock


class _Servers:
    def __init__(self) -> None:
        self.servers: list[tuple[uvicorn.Server, socket.socket]] = []
        self.tasks: list[asyncio.Task[None]] = []

    async def start(self, app: Any, lifespan: Literal["on", "off"] = "on") -> str:
        sock = _socket()
        server = uvicorn.Server(uvicorn.Config(app, log_level="error", lifespan=lifespan))
        self.servers.append((server, sock))
        self.tasks.append(asyncio.create_task(server.serve(sockets=[sock])))
        deadline = time.monotonic() + 10
        while not server.started:
            if time.monotonic() > deadline or self.tasks[-1].done():
                raise RuntimeError("server did not start")
            await asyncio.sleep(0.01)
        return f"http://127.0.0.1:{sock.getsockname()[1]}"

    async def stop(self) -> None:
        for server, _ in self.servers:
            server.should_exit = True
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for _, sock in self.servers:
            sock.close()


async def _demo(out: Any) -> int:
    servers = _Servers()
    try:
        d_url = await servers.start(create_decode_app(DecodeSimConfig(port=0, max_model_len=4096)))
        releaser = DryRunReleaser()
        app = create_app(
            Config(decode_url=d_url, release="dry-run", log_level="error"), Deps(releaser=releaser)
        )
        url = await servers.start(app)
        admin = await servers.start(create_admin_app(app), lifespan="off")
        down = create_app(Config(decode_url=f"http://127.0.0.1:{_closed_port()}"), Deps(releaser=releaser))
        down_url = await servers.start(down)
        return await _drive(out, url, down_url, admin, releaser, [app, down])
    finally:
        await servers.stop()


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def _drive(
    out: Any, url: str, down_url: str, admin: str, releaser: DryRunReleaser, apps: list[ProxyApp]
) -> int:
    cases = [*CASES, Case("D down (connection refused)", _chat("hi"), expect_release=True)]
    rows = []
    async with httpx.AsyncClient(timeout=30) as client:
        for index, case in enumerate(cases):
            request_id = f"demo-{index}"
            body = dict(case.body)
            if case.name != "no kv_transfer_params (not P/D)":
                body["kv_transfer_params"] = _params(f"cmpl-{request_id}-0")
            base = down_url if case.name.startswith("D down") else url
            response = await client.post(base + case.route, json=body, headers={"x-request-id": request_id})
            rows.append((case, request_id, response.status_code))
        for app in apps:  # every queued release job finished
            assert app.runtime is not None
            await app.runtime.pipeline.flush(5.0)
        metrics = (await client.get(admin + "/metrics")).text
    released = {job.request_id: job for job in releaser.recorded}
    return _report(out, rows, released, metrics)


def _report(out: Any, rows: list[tuple[Case, str, int]], released: dict[str, Any], metrics: str) -> int:
    ok = True
    print(f"{'request':46} {'D said':>6}  {'released (dry-run)':40}", file=out)
    print("-" * 96, file=out)
    for case, request_id, status in rows:
        job = released.get(request_id)
        what = f"{job.cause}: {job.params.remote_request_id} on {job.params.remote_engine_id}" if job else "-"
        good = (job is not None) == case.expect_release
        ok &= good
        print(f"{case.name:46} {status:>6}  {what:40}{'' if good else '  << UNEXPECTED'}", file=out)
    print("\nmetrics of the sidecar in front of the live D:", file=out)
    for line in metrics.splitlines():
        if line.startswith(("kvr_rejections_total", "kvr_releases_total")):
            print("  " + line, file=out)
    rejections = sum(c.expect_release for c, _, _ in rows)
    verdict = "every decision as expected" if ok else "SOME DECISIONS WERE WRONG"
    print(f"\n{len(released)} release jobs recorded for {rejections} rejections; {verdict}.", file=out)
    return 0 if ok else 1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quiet", action="store_true", help="print nothing, only the exit code")


def run(args: argparse.Namespace) -> int:
    logs.setup("error", "text")
    if args.quiet:
        with open(os.devnull, "w") as devnull:
            return asyncio.run(_demo(devnull))
    return asyncio.run(_demo(sys.stdout))
