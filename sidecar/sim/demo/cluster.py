"""The demo's cluster on loopback, in one process: P, "vLLM D", and the sidecar in front of D.

``demo_cluster(settings)`` starts, on ephemeral 127.0.0.1 ports and one
event loop in a background thread: the prefill simulator (real NIXL agents,
one per TP rank, a small block pool and a short lease), the decode
simulator in "vLLM D" mode (it notifies P over NIXL for the requests it
admits, and on 0.21.0+ for the rejections its handler raises), the sidecar
with the chosen release strategy and its admin app, and a second sidecar in
front of a decode port nothing listens on (D down). Both sidecars are told
the vLLM release (``vllm_version``), since a D that is down cannot be asked.
Leaving the block stops every server; each one's lifespan closes its agents.
"""

from __future__ import annotations

import asyncio
import importlib.util
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

import uvicorn
from prometheus_client import CollectorRegistry

from sidecar.app import Deps, create_admin_app, create_app
from sidecar.config import Config
from sidecar.sim.decode import create_decode_app
from sidecar.sim.decode.config import DecodeSimConfig
from sidecar.sim.decode.nixl import VllmDHooks
from sidecar.sim.prefill import create_prefill_app
from sidecar.sim.prefill.config import PrefillSimConfig

START_TIMEOUT = 30.0


@dataclass(frozen=True)
class ClusterSettings:
    """What differs between demo runs and modes."""

    vllm_version: str
    release: Literal["off", "nixl"]
    num_blocks: int
    lease: float
    max_model_len: int  # D's, in words
    max_concurrency: int  # D's admission control (vLLM 0.29.0+ --max-num-queued-reqs)
    api_key: str
    tp: int = 2
    model: str = "sim-model"
    stream_events: int = 8
    event_delay: float = 0.01


@dataclass(frozen=True)
class ClusterUrls:
    """Where everything listens."""

    prefill: str
    decode: str
    sidecar: str
    sidecar_admin: str
    down_sidecar: str  # a sidecar whose D is down
    down_sidecar_admin: str


def _bind() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(2048)
    sock.setblocking(False)
    return sock


class ServerGroup:
    """ASGI apps served by uvicorn on one event loop in a background thread."""

    def __init__(self) -> None:
        self._pending: list[tuple[Any, Literal["on", "off"], socket.socket]] = []
        self._servers: list[uvicorn.Server] = []
        self._thread = threading.Thread(target=self._run, name="demo-servers", daemon=True)
        self._failed: BaseException | None = None
        self._held: list[socket.socket] = []

    def add(self, app: Any, lifespan: Literal["on", "off"] = "on") -> str:
        """Register ``app``; returns its URL (the port is bound now, served on ``start``)."""
        sock = _bind()
        self._pending.append((app, lifespan, sock))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"

    def refusing(self) -> str:
        """A URL whose port is held but never listens: connections to it are refused (D down), and
        nothing else can take the port while the group runs."""
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        self._held.append(sock)
        return f"http://127.0.0.1:{sock.getsockname()[1]}"

    def _run(self) -> None:
        loop = _new_loop()
        try:
            loop.run_until_complete(self._serve())
        except BaseException as exc:  # reported by start()
            self._failed = exc
        finally:
            loop.close()

    async def _serve(self) -> None:
        http = "httptools" if importlib.util.find_spec("httptools") else "h11"
        for app, lifespan, _ in self._pending:
            config = uvicorn.Config(app, log_level="error", lifespan=lifespan, http=http, access_log=False)
            self._servers.append(uvicorn.Server(config))
        await asyncio.gather(
            *(s.serve(sockets=[p[2]]) for s, p in zip(self._servers, self._pending, strict=True))
        )

    def start(self) -> None:
        """Serve every app; returns once all have started (raises if one could not)."""
        self._thread.start()
        deadline = time.monotonic() + START_TIMEOUT
        while len(self._servers) < len(self._pending) or not all(s.started for s in self._servers):
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"a demo server did not start: {self._failed or 'see the log above'}")
            time.sleep(0.01)

    def stop(self) -> None:
        """Ask every server to exit (lifespans close their resources) and wait."""
        for server in self._servers:
            server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(START_TIMEOUT)
        for sock in [*(pending[2] for pending in self._pending), *self._held]:
            sock.close()


def _new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        return asyncio.new_event_loop()
    loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
    return loop


def _sidecar(settings: ClusterSettings, decode_url: str) -> Any:
    config = Config(
        decode_url=decode_url,
        release=settings.release,
        prefill_allow=("127.0.0.1",),
        vllm_version=settings.vllm_version,
        p_hold_seconds=settings.lease,  # the saving the sidecar estimates counts P's real lease
        retried_statuses=("none",),  # the load generator talks to the sidecar: nothing retries
        log_level="error",
        log_format="text",
    )
    return create_app(config, Deps(registry=CollectorRegistry()))


@contextmanager
def demo_cluster(settings: ClusterSettings) -> Iterator[ClusterUrls]:
    """Run the cluster for the duration of the block (see the module docstring)."""
    version = settings.vllm_version
    prefill = PrefillSimConfig(
        port=0,
        vllm_version=version,
        tp=settings.tp,
        num_blocks=settings.num_blocks,
        lease=settings.lease,
        side_channel_port=0,
        model=settings.model,
        log_level="error",
    )
    decode = DecodeSimConfig(
        port=0,
        version=version,
        model=settings.model,
        max_model_len=settings.max_model_len,
        max_concurrency=settings.max_concurrency,
        api_key=settings.api_key,
        stream_events=settings.stream_events,
        event_delay=settings.event_delay,
        vllm_d=True,
    )
    group = ServerGroup()
    p_url = group.add(create_prefill_app(prefill))
    d_url = group.add(create_decode_app(decode, VllmDHooks(version)))
    sidecar = _sidecar(settings, d_url)
    down = _sidecar(settings, group.refusing())
    urls = ClusterUrls(
        prefill=p_url,
        decode=d_url,
        sidecar=group.add(sidecar),
        sidecar_admin=group.add(create_admin_app(sidecar), "off"),
        down_sidecar=group.add(down),
        down_sidecar_admin=group.add(create_admin_app(down), "off"),
    )
    group.start()
    try:
        yield urls
    finally:
        group.stop()
