"""App factory: ``create_app(config, deps=None)`` builds the proxy ASGI app.

The lifespan owns every resource and hands them to the handlers through
``Runtime`` (``sidecar.app.runtime``); nothing is wired at import time. It
builds, in order: the client to D, D's state (``DecodeState``, one for the
whole process: the judge reads it, the strategies ask it for D's release,
``/readyz`` for D's health), the release strategy and its pipeline, the proxy
(and router mode on its admission step), then the data-parallel ranks. The admin app is
``sidecar.app.admin``.

With an InferencePool to watch, start-up does not wait for its first list: the
proxy port serves at once and answers every request 503 until the pool and its
pods are listed, or ``FIRST_SYNC_SECONDS`` have passed (then a prefiller the
lists do not hold is refused, as before); ``/readyz`` says when they came. A
port that accepted connections and answered none would hold a gateway's
requests for those seconds, and a SIGTERM in them would wait for the lists.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from sidecar import retries
from sidecar.app.decode_ranks import start_ranks
from sidecar.app.ranks import RANK, rank_url
from sidecar.app.runtime import Deps, Runtime
from sidecar.app.shared import SharedInFlight
from sidecar.asgi import Receive, Scope, Send
from sidecar.config import Config, dump
from sidecar.decision.judge import InFlight
from sidecar.decode.notice import VersionNotice
from sidecar.decode.state import DecodeState
from sidecar.k8s import FIRST_SYNC_SECONDS, watched_allowlists
from sidecar.observability.metrics import Metrics, releases_enabled
from sidecar.observability.tracing import Tracing
from sidecar.observability.tracing import build as build_tracing
from sidecar.proxy import Proxy, ProxyParts
from sidecar.proxy.answers import STYLES
from sidecar.proxy.handler import Injector, RouterMode
from sidecar.proxy.headers import request_headers
from sidecar.proxy.trust import Trust
from sidecar.release import make_releaser
from sidecar.release.base import Releaser
from sidecar.release.hold import hold_seconds
from sidecar.release.ledger import Ledger
from sidecar.release.pipeline import BreakerPolicy, Pipeline, Retry, Settings
from sidecar.release.shared import SharedLedger
from sidecar.router.legs import Router
from sidecar.router.pool import PrefillPool
from sidecar.tls.client import outbound
from sidecar.upstream import Client, Upstream

log = logging.getLogger("sidecar.app")

NOT_STARTED = "the sidecar is starting: its InferencePool is not listed yet; retry shortly"


class ProxyApp:
    """The ASGI app on the proxy port: lifespan plus the catch-all proxy."""

    def __init__(self, config: Config, deps: Deps | None = None) -> None:
        self.config = config
        self.deps = deps or Deps()
        self.answers = STYLES[config.answers]  # the style of the sidecar's own answers, picked once
        self.runtime: Runtime | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            runtime = self.runtime
            assert runtime is not None, "lifespan did not run"
            if runtime.starting is not None and not runtime.starting.done():
                await self._not_started(scope, send)
                return
            rank = scope.get(RANK, 0)
            await (runtime.ranks[rank - 1].proxy if rank else runtime.proxy)(scope, receive, send)
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

    async def _not_started(self, scope: Scope, send: Send) -> None:
        """503 while the InferencePool is first listed, in the answers' shape (the body unread)."""
        await self.answers.unavailable(send, NOT_STARTED, request_headers(scope["headers"])[1])

    async def startup(self) -> Runtime:
        config, deps = self.config, self.deps
        tracing = deps.tracing or build_tracing(config)
        metrics = Metrics(deps.registry)
        releases_enabled(metrics, config.release, config.releases_off_for)
        upstream = deps.upstream or _upstream(config)
        await upstream.start()
        # D's state probes on its own connection: a probe never waits behind a full request pool
        # (a D seen as gone under load would have its own releases sent twice), and a request
        # never reuses a probe's connection.
        probes = None if deps.upstream is not None else _upstream(config, pool_size=1)
        if probes is not None:
            await probes.start()
        notice = VersionNotice(
            config.unknown_vllm, metrics.unknown_vllm, metrics.version_unusable, config.vllm_version
        )
        notice.seen(config.vllm_version)
        decode = DecodeState(
            probes or upstream,
            interval=config.decode_health_interval,
            kv_connector=config.decode_kv_connector,
            on_version=notice.read,
        )
        await decode.start()
        # NIXL targets, router mode's P: static, watched, or (a worker) the supervisor's watch's
        lists = watched_allowlists(config, deps.shared.pool_lists if deps.shared is not None else None)
        releaser = deps.releaser or make_releaser(
            config, decode.decode_version, metrics.registry, tracing, lists.release
        )
        await releaser.start()
        pipeline = _pipeline(config, releaser, metrics, tracing, deps, _hold(config, decode))
        pipeline.start()
        inflight = (
            InFlight(config.ledger_size, config.release_deadline)
            if deps.shared is None
            else SharedInFlight(deps.shared.table, deps.shared.index, config.release_deadline)
        )
        trust = deps.trust or Trust(config)
        pool = deps.pool or PrefillPool.of(config, lists.prefill, self.answers)
        parts = ProxyParts(
            upstream=upstream,
            pipeline=pipeline,
            metrics=metrics,
            trust=trust,
            inflight=inflight,
            injector=deps.injector or Injector(config),
            decode=decode,
            routing=_routing(config, pool, metrics, trust, tracing),
            tracing=tracing,
        )
        proxy = Proxy(config, parts)
        ranks = await start_ranks(config, parts, _upstream)  # before /readyz sees any
        self.runtime = Runtime(
            config, metrics, upstream, decode, probes, releaser, pipeline, inflight, proxy, tracing
        )
        self.runtime.pool_watch, self.runtime.ranks = lists.watch, ranks
        if lists.watch is not None:  # served at once, 503 until the first lists (module docstring)
            self.runtime.starting = asyncio.create_task(lists.watch.first_list(FIRST_SYNC_SECONDS))
        _started(config, releaser.checked)
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
            await runtime.proxy.router.close()
        await runtime.close()
        await runtime.upstream.close()
        await runtime.tracing.shutdown(self.config.flush_timeout)  # last: the release spans ended
        log.info("sidecar stopped", extra={"releases_flushed": flushed})


def _upstream(config: Config, rank: int = 0, pool_size: int | None = None) -> Client:
    return Upstream(
        rank_url(config.decode_url, rank),
        connect_timeout=config.connect_timeout,
        pool_timeout=config.pool_timeout,
        header_timeout=config.header_timeout,
        read_timeout=config.read_timeout,
        pool_size=pool_size or config.pool_size,
    ).use_tls(outbound(config, config.decode_tls_insecure))


def _pipeline(
    config: Config,
    releaser: Releaser,
    metrics: Metrics,
    tracing: Tracing,
    deps: Deps,
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
    ledger = (
        Ledger(config.ledger_size, config.ledger_ttl, deps.clock)
        if deps.shared is None
        else SharedLedger(deps.shared.table, config.ledger_ttl)
    )
    return Pipeline(releaser, metrics, ledger, settings, deps.clock, tracing)


def create_app(config: Config, deps: Deps | None = None) -> ProxyApp:
    """The proxy-port ASGI app. Serve it with lifespan on."""
    return ProxyApp(config, deps)


def _routing(
    config: Config, pool: PrefillPool | None, metrics: Metrics, trust: Trust, tracing: Tracing
) -> Callable[[Proxy], RouterMode] | None:
    """Router mode, built on each proxy's admission step, when there is a P pool (or llm-d's header)."""
    return (
        None if pool is None else lambda proxy: Router(proxy, pool, config, metrics, trust.outgoing, tracing)
    )


def _hold(config: Config, decode: DecodeState) -> Callable[[], float]:
    """P's hold of an unreleased request's blocks, by the last known release of D (and P)."""
    return lambda: hold_seconds(config.vllm_version or decode.view().version, config.p_hold_seconds)


def _started(config: Config, live: bool) -> None:
    """The start-up lines: the effective config, and what an operator must know of it."""
    log.info("sidecar started", extra={"config": dump(config)})
    if live and not config.prefill:  # in router mode a retry runs a fresh prefill
        injected = config.inject_statuses if config.inject_rate or config.inject_header else ()
        retries.announce(log, config.retried_statuses, injected)
    if config.dry_run:
        log.warning(
            "dry run: every release is decided and checked as --release %s would, and none is sent "
            '(kvr_releases_total{result="would_send"})',
            config.release,
        )
