"""App factory: ``create_app(config, deps=None)`` builds the proxy ASGI app.

The lifespan owns every resource (the upstream client, the release strategy
and its pipeline) and hands them to the handlers through ``Runtime``; nothing
is wired at import time. The admin app (``/healthz``, ``/readyz``,
``/metrics``) is a separate Starlette app served on the admin port, so D's
own ``/health`` and ``/metrics`` stay reachable through the proxy port.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from sidecar import retries
from sidecar.asgi import Receive, Scope, Send
from sidecar.classify import Failure
from sidecar.config import Config, dump
from sidecar.decode_state import DecodeState
from sidecar.faults import Injector
from sidecar.k8s import PoolWatch, watched_allowlists
from sidecar.llmd.decode_ranks import Rank, ranks_ready, start_ranks
from sidecar.llmd.ranks import RANK, rank_url
from sidecar.metrics import Metrics
from sidecar.proxy import Proxy, ProxyParts
from sidecar.release import make_releaser
from sidecar.release.base import Releaser
from sidecar.release.ledger import Ledger
from sidecar.release.pipeline import Pipeline, Retry, Settings
from sidecar.release.targets import BreakerPolicy
from sidecar.release.value import hold_seconds
from sidecar.router.pool import PrefillPool
from sidecar.tls.client import outbound
from sidecar.tracing import Tracing
from sidecar.tracing import build as build_tracing
from sidecar.trust import InFlight, Trust
from sidecar.upstream import Client, Upstream, UpstreamError

log = logging.getLogger("sidecar.app")

HEALTH_CACHE_SECONDS = 1.0
VERSION_CACHE_SECONDS = 300.0


@dataclass
class Deps:
    """Injected collaborators (tests); anything left None is built from the config."""

    registry: CollectorRegistry | None = None
    releaser: Releaser | None = None
    clock: Callable[[], float] = time.monotonic
    tracing: Tracing | None = None  # e.g. sidecar.tracing.build(config, InMemorySpanExporter())
    upstream: Client | None = None  # the client to D (a fake in unit tests)
    trust: Trust | None = None  # built once by ``serve`` (it reads the secret files)
    injector: Injector | None = None
    pool: PrefillPool | None = None  # router mode's P servers


@dataclass
class Runtime:
    """What the lifespan built; handlers reach it through the app."""

    config: Config
    metrics: Metrics
    upstream: Client
    releaser: Releaser
    pipeline: Pipeline
    inflight: InFlight
    proxy: Proxy
    tracing: Tracing
    draining: bool = False
    _health: tuple[float, bool] = (0.0, False)
    _version: tuple[float, str | None] = (0.0, None)
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    _refresh: asyncio.Task[str | None] | None = None
    # D's state (engine alive, shutting down, KV connector), polled while releases are sent.
    decode: DecodeState | None = None
    probes: Client | None = None  # DecodeState's own client to D
    ranks: list[Rank] = field(default_factory=list)  # data-parallel ranks 1..N-1 (0 is ``proxy``)
    pool_watch: PoolWatch | None = None  # the InferencePool's pods, when inference_pool is set

    async def decode_healthy(self) -> bool:
        """D's ``GET /health`` is 200 (cached for a second; the poller's view when it runs)."""
        if self.decode is not None:
            return self.decode.view().engine == "alive"
        checked, healthy = self._health
        if time.monotonic() - checked < HEALTH_CACHE_SECONDS:
            return healthy
        try:
            async with await self.upstream.send("GET", "/health", [], None, header_timeout=2.0) as response:
                healthy = response.status == 200
        except UpstreamError:
            healthy = False
        self._health = (time.monotonic(), healthy)
        return healthy

    async def decode_version(self, quiet: bool = False) -> str | None:
        """D's vLLM release from ``GET /version`` (cached; P and D run the same release);
        ``quiet``: a failure is not worth a warning (at start-up D may not be up yet)."""
        if self.decode is not None:
            return await self.decode.decode_version()
        checked, version = self._version
        if version and time.monotonic() - checked < VERSION_CACHE_SECONDS:
            return version
        async with self._lock:
            try:
                async with await self.upstream.send(
                    "GET", "/version", [], None, header_timeout=2.0
                ) as response:
                    body = await response.read(4096)
                    if response.status == 200:
                        version = msgspec.json.decode(body, type=dict[str, object]).get("version")  # type: ignore[assignment]
            except (UpstreamError, msgspec.DecodeError, msgspec.ValidationError) as exc:
                log.log(
                    logging.DEBUG if quiet else logging.WARNING,
                    "cannot read D's /version",
                    extra={"detail": str(exc)},
                )
                return None
            if not isinstance(version, str):
                return None
            self._version = (time.monotonic(), version)
            return version

    # --- what the judge reads of D (sidecar.proxy.judge.DecodeFacts) -----------------------

    def version(self) -> str | None:
        """D's release as last read, without waiting; a stale or missing answer is refreshed
        in the background."""
        if self.decode is not None:
            return self.decode.view().version
        checked, version = self._version
        stale = version is None or time.monotonic() - checked >= VERSION_CACHE_SECONDS
        if stale and (self._refresh is None or self._refresh.done()):
            self._refresh = asyncio.get_running_loop().create_task(self.decode_version())
        return version

    def can_notify(self) -> bool:
        """D's engine could send its own release now (``sidecar.decode_state``)."""
        if self.decode is not None:
            return self.decode.view().can_notify
        return not self.draining

    def observe(self, signal: Failure | int, message: str | None = None, *, closing: bool = False) -> None:
        if self.decode is not None:
            self.decode.observe(signal, message, closing=closing)

    def drain(self) -> None:
        """SIGTERM: readiness off; D, in this pod, is terminating too."""
        self.draining = True
        for rank in self.ranks:
            rank.drain()
        if self.decode is not None:
            self.decode.draining()

    def p_hold(self) -> float:
        """P's hold of an unreleased request's blocks, by the last known release of D (and P)."""
        version = self.config.vllm_version or (
            self.decode.view().version if self.decode else self._version[1]
        )
        return hold_seconds(version, self.config.p_hold_seconds)

    async def ready(self) -> tuple[bool, dict[str, bool]]:
        checks = {
            "draining": self.draining,
            "decode": await self.decode_healthy(),
            "releaser": self.releaser.ready(),
        }
        checks |= await ranks_ready(self.ranks)  # each rank's D, when there are data-parallel ranks
        checks |= {"inference_pool": self.pool_watch.synced} if self.pool_watch is not None else {}
        ok = not checks["draining"] and all(v for k, v in checks.items() if k != "draining")
        self.metrics.ready.set(1 if ok else 0)
        return ok, checks

    async def close(self) -> None:
        if self.pool_watch is not None:
            await self.pool_watch.close()
        await asyncio.gather(*(r.close() for r in self.ranks))
        if self.decode is not None:
            await self.decode.close()
        if self.probes is not None:
            await self.probes.close()
        if self._refresh is not None:
            self._refresh.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._refresh


class ProxyApp:
    """The ASGI app on the proxy port: lifespan plus the catch-all proxy."""

    def __init__(self, config: Config, deps: Deps | None = None) -> None:
        self.config = config
        self.deps = deps or Deps()
        self.runtime: Runtime | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            assert self.runtime is not None, "lifespan did not run"
            rank = scope.get(RANK, 0)
            await (self.runtime.ranks[rank - 1].proxy if rank else self.runtime.proxy)(scope, receive, send)
        elif scope["type"] == "lifespan":
            await self._lifespan(receive, send)
        else:  # websocket: vLLM serves none on these routes
            await send({"type": "websocket.close", "code": 1003})

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    await self.startup()
                except Exception as exc:
                    log.exception("start-up failed")
                    await send({"type": "lifespan.startup.failed", "message": str(exc)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.shutdown()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def startup(self) -> Runtime:
        config, deps = self.config, self.deps
        tracing = deps.tracing or build_tracing(config)
        metrics = Metrics(deps.registry)
        upstream = deps.upstream or _upstream(config)
        await upstream.start()
        holder: list[Runtime] = []

        async def decode_version() -> str | None:
            return await holder[0].decode_version()

        lists = await watched_allowlists(config)  # NIXL targets, router mode's P: static or watched
        releaser = deps.releaser or make_releaser(
            config, decode_version, metrics.registry, tracing, lists.release
        )
        await releaser.start()
        pipeline = _pipeline(config, releaser, metrics, tracing, deps.clock, lambda: holder[0].p_hold())
        pipeline.start()
        inflight = InFlight(config.ledger_size, config.release_deadline)
        parts = ProxyParts(
            upstream=upstream,
            pipeline=pipeline,
            metrics=metrics,
            trust=deps.trust or Trust(config),
            inflight=inflight,
            injector=deps.injector or Injector(config),
            facts=_Facts(holder),
            pool=deps.pool or PrefillPool.of(config, lists.prefill),
            tracing=tracing,
        )
        proxy = Proxy(config, parts)
        ranks = await start_ranks(config, parts, _upstream, releaser.frees)  # before /readyz sees any
        self.runtime = Runtime(config, metrics, upstream, releaser, pipeline, inflight, proxy, tracing)
        self.runtime.pool_watch, self.runtime.ranks = lists.watch, ranks
        holder.append(self.runtime)
        if releaser.frees:  # what D's engine can release itself decides what the sidecar sends
            # Probes have their own connection to D: they never wait behind a full request pool
            # (a D seen as gone under load would have its own releases sent twice), and a request
            # never reuses a probe's connection.
            probes = deps.upstream or _upstream(config, pool_size=1)
            if probes is not upstream:
                await probes.start()
                self.runtime.probes = probes
            self.runtime.decode = DecodeState(
                probes, interval=config.decode_health_interval, kv_connector=config.decode_kv_connector
            )
            await self.runtime.decode.start()
        log.info("sidecar started", extra={"config": dump(config)})
        if releaser.frees and not config.prefill:  # in router mode a retry runs a fresh prefill
            injected = config.inject_statuses if config.inject_rate or config.inject_header else ()
            retries.announce(log, config.retried_statuses, injected)
        if config.dry_run:
            log.warning(
                "dry run: every release is decided and checked as --release %s would, and none is sent "
                '(kvr_releases_total{result="would_send"})',
                config.release,
            )
        return self.runtime

    async def shutdown(self) -> None:
        """Flush queued releases (bounded), then close every resource."""
        runtime = self.runtime
        if runtime is None:
            return
        runtime.drain()
        for proxy in (runtime.proxy, *(r.proxy for r in runtime.ranks)):
            proxy.stopping = True
        runtime.pipeline.hurry()
        flushed = await runtime.pipeline.flush(self.config.flush_timeout)
        await runtime.pipeline.stop()
        await runtime.releaser.close()
        if runtime.proxy.router is not None:
            await runtime.proxy.router.pool.close()
        await runtime.close()
        await runtime.upstream.close()
        await runtime.tracing.shutdown(self.config.flush_timeout)  # last: the release spans ended
        log.info("sidecar stopped", extra={"releases_flushed": flushed})


class _Facts:
    """``DecodeFacts`` for the judge, read from the runtime once it exists."""

    def __init__(self, holder: list[Runtime]) -> None:
        self._holder = holder

    def version(self) -> str | None:
        return self._holder[0].version() if self._holder else None

    def can_notify(self) -> bool:
        return self._holder[0].can_notify() if self._holder else True

    def observe(self, signal: Failure | int, message: str | None = None, *, closing: bool = False) -> None:
        if self._holder:
            self._holder[0].observe(signal, message, closing=closing)


def _upstream(config: Config, rank: int = 0, pool_size: int | None = None) -> Client:
    return Upstream(
        rank_url(config.decode_url, rank),
        connect_timeout=config.connect_timeout,
        pool_timeout=config.pool_timeout,
        header_timeout=config.header_timeout,
        read_timeout=config.read_timeout,
        pool_size=pool_size or config.pool_size,
    ).use_tls(outbound(config, "decoder"))


def _pipeline(
    config: Config,
    releaser: Releaser,
    metrics: Metrics,
    tracing: Tracing,
    clock: Callable[[], float],
    hold: Callable[[], float],
) -> Pipeline:
    settings = Settings(
        queue_size=config.release_queue_size,
        workers=config.release_workers,
        retry=Retry(config.release_retry_initial, config.release_retry_max),
        target_share=config.release_target_share,
        breaker=BreakerPolicy(failures=config.release_target_failures),
        hold=hold,
    )
    return Pipeline(
        releaser, metrics, Ledger(config.ledger_size, config.ledger_ttl, clock), settings, clock, tracing
    )


def create_app(config: Config, deps: Deps | None = None) -> ProxyApp:
    """The proxy-port ASGI app. Serve it with lifespan on."""
    return ProxyApp(config, deps)


def create_admin_app(app: ProxyApp) -> Starlette:
    """The admin-port app, reading the proxy app's runtime."""

    def runtime() -> Runtime:
        assert app.runtime is not None
        return app.runtime

    async def healthz(request: Request) -> Response:
        return PlainTextResponse("ok")

    async def readyz(request: Request) -> Response:
        if app.runtime is None:
            return JSONResponse({"ready": False, "checks": {"started": False}}, status_code=503)
        ok, checks = await runtime().ready()
        body: dict[str, object] = {"ready": ok, "checks": checks}
        detail = runtime().releaser.detail()
        if detail:
            body["release"] = detail
        return JSONResponse(body, status_code=200 if ok else 503)

    async def metrics(request: Request) -> Response:
        if app.runtime is not None:
            app.runtime.metrics.queue_depth.set(app.runtime.pipeline.depth)
            if app.runtime.decode is not None:
                app.runtime.metrics.decode_can_notify.set(1 if app.runtime.decode.view().can_notify else 0)
        registry = app.runtime.metrics.registry if app.runtime else CollectorRegistry()
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    routes = [
        Route("/healthz", healthz),
        Route("/readyz", readyz),
        Route("/metrics", metrics),
    ]
    return Starlette(routes=routes)
