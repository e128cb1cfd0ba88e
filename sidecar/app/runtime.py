"""What the lifespan builds, and what the handlers and the admin port read of it.

``Deps`` holds the collaborators a test injects (anything left ``None`` is built
from the config). ``Runtime`` holds what start-up built: the client to D, D's
state (the one reader of D's ``/health``, ``/version`` and ``/metrics``), the
release strategy and its pipeline, the proxy and the data-parallel ranks.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client import CollectorRegistry

from sidecar.app.decode_ranks import Rank, ranks_ready
from sidecar.config import Config
from sidecar.decision.judge import InFlight
from sidecar.decode.state import DecodeState
from sidecar.k8s import PoolWatch
from sidecar.observability.metrics import Metrics
from sidecar.observability.tracing import Tracing
from sidecar.proxy import Proxy
from sidecar.proxy.handler import Injector
from sidecar.proxy.trust import Trust
from sidecar.release.base import Releaser
from sidecar.release.pipeline import Pipeline
from sidecar.release.shared import SharedTable
from sidecar.router.pool import PrefillPool
from sidecar.upstream import Client


@dataclass
class Deps:
    """Injected collaborators (tests); anything left None is built from the config."""

    registry: CollectorRegistry | None = None
    releaser: Releaser | None = None
    clock: Callable[[], float] = time.monotonic
    tracing: Tracing | None = None  # e.g. sidecar.observability.tracing.build(config, InMemorySpanExporter())
    upstream: Client | None = None  # the client to D (a fake in unit tests; D's probes use it too)
    trust: Trust | None = None  # built once by ``serve`` (it reads the secret files)
    injector: Injector | None = None
    pool: PrefillPool | None = None  # router mode's P servers
    # One of several worker processes (``workers``): the ledger and the veto on the shared table.
    shared: Worker | None = None


@dataclass(frozen=True)
class Worker:
    """This worker process's place among its siblings: its index, the table they share, and the
    file of the supervisor's InferencePool lists (``sidecar.k8s.shared``; None: no pool)."""

    index: int
    table: SharedTable
    pool_lists: Path | None = None


@dataclass
class Runtime:
    """What the lifespan built; handlers reach it through the app."""

    config: Config
    metrics: Metrics
    upstream: Client
    decode: DecodeState  # D's state: what the judge reads of D, the strategies' release of D, /readyz
    probes: Client | None  # DecodeState's own connection to D (None: it shares ``upstream``)
    releaser: Releaser
    pipeline: Pipeline
    inflight: InFlight
    proxy: Proxy
    tracing: Tracing
    draining: bool = False
    ranks: list[Rank] = field(default_factory=list)  # data-parallel ranks 1..N-1 (0 is ``proxy``)
    pool_watch: PoolWatch | None = None  # the InferencePool's pods, when inference_pool is set
    starting: asyncio.Task[None] | None = None  # the wait for the pool's first lists (503 until done)

    def drain(self) -> None:
        """SIGTERM: readiness off; D, in this pod, is terminating too."""
        self.draining = True
        for rank in self.ranks:
            rank.drain()
        self.decode.draining()

    async def ready(self) -> tuple[bool, dict[str, bool]]:
        checks = {
            "draining": self.draining,
            "decode": (await self.decode.fresh()).engine == "alive",
            "releaser": self.releaser.ready(),
        }
        checks |= await ranks_ready(self.ranks)  # each rank's D, when there are data-parallel ranks
        checks |= {"inference_pool": self.pool_watch.synced} if self.pool_watch is not None else {}
        ok = not checks["draining"] and all(v for k, v in checks.items() if k != "draining")
        self.metrics.ready.set(1 if ok else 0)
        return ok, checks

    async def close(self) -> None:
        if self.starting is not None:
            self.starting.cancel()
            await asyncio.gather(self.starting, return_exceptions=True)
        if self.pool_watch is not None:
            await self.pool_watch.close()
        await asyncio.gather(*(r.close() for r in self.ranks))
        await self.decode.close()
        if self.probes is not None:
            await self.probes.close()
