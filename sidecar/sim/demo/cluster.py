"""The demo's cluster on loopback, in one process: P, "vLLM D", and the sidecar in front of D.

``demo_cluster(settings)`` starts, on ephemeral 127.0.0.1 ports, each
server in a background thread (``sidecar.sim.servers``): the prefill simulator (real NIXL agents,
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
import contextlib
import importlib.util
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

from prometheus_client import CollectorRegistry

from sidecar.app import Deps, create_admin_app, create_app
from sidecar.config import Config
from sidecar.sim.decode import create_decode_app
from sidecar.sim.decode.config import DecodeSimConfig
from sidecar.sim.decode.nixl import VllmDHooks
from sidecar.sim.prefill import create_prefill_app
from sidecar.sim.prefill.config import PrefillSimConfig
from sidecar.sim.servers import serve


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
    options: dict[str, Any] = {"log_level": "error", "access_log": False, "loop_factory": _new_loop}
    options["http"] = "httptools" if importlib.util.find_spec("httptools") else "h11"
    with contextlib.ExitStack() as stack, socket.socket() as refusing:
        # D that is down: a port held but never listening, so connections to it are refused and
        # nothing else can take it while the demo runs.
        refusing.bind(("127.0.0.1", 0))
        p = stack.enter_context(serve(create_prefill_app(prefill), **options))
        d = stack.enter_context(serve(create_decode_app(decode, VllmDHooks(version)), **options))
        up = _sidecar(settings, d.url)
        down = _sidecar(settings, f"http://127.0.0.1:{refusing.getsockname()[1]}")
        sidecar = stack.enter_context(serve(up, create_admin_app(up), **options))
        down_sidecar = stack.enter_context(serve(down, create_admin_app(down), **options))
        yield ClusterUrls(
            prefill=p.url,
            decode=d.url,
            sidecar=sidecar.url,
            sidecar_admin=sidecar.urls[1],
            down_sidecar=down_sidecar.url,
            down_sidecar_admin=down_sidecar.urls[1],
        )
