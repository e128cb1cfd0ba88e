"""The proxy's ASGI entry: one request, read once, sent down the one path it takes.

Every method and path goes to D unchanged (``Forwarder.passthrough``). For
``POST`` on ``/v1/chat/completions``, ``/v1/completions`` and
``/v1/responses`` the body is read once under the cap and the request takes
the router's path (``sidecar.router.legs``) when router mode applies, else
the sidecar's: refused if its parameters were already released (409), if the
sidecar is draining (503) or if a rejection is injected, otherwise forwarded
and judged. Requests above ``limit_concurrency`` and bodies over the cap are
answered by ``Refusals``.

This is a plain ASGI callable rather than a Starlette route: the catch-all
needs no routing, and skipping the framework's request objects keeps the
proxy's CPU per request low.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass

from sidecar.asgi import Receive, Scope, Send, over_limit
from sidecar.config import Config
from sidecar.decision.judge import DecodeWatch, InFlight, Judge
from sidecar.decision.policy import SIDECAR
from sidecar.observability.metrics import Metrics
from sidecar.observability.tracing import OFF, Tracing
from sidecar.proxy.admit import Admission, Collaborators, RouterMode
from sidecar.proxy.answers import STYLES, send_error
from sidecar.proxy.body import ClientGone, Oversized, read_body
from sidecar.proxy.context import RequestContext
from sidecar.proxy.disconnect import uncancel
from sidecar.proxy.forward import Forwarder
from sidecar.proxy.inject import Injector
from sidecar.proxy.inspect import Inspector
from sidecar.proxy.refusals import SHUTTING_DOWN, Refusals
from sidecar.proxy.trust import Trust
from sidecar.release.pipeline import Pipeline
from sidecar.transport.relay import RELAY
from sidecar.upstream import Client


@dataclass
class ProxyParts:
    """What the proxy works with; the app builds them from the config (tests inject fakes)."""

    upstream: Client
    pipeline: Pipeline
    metrics: Metrics
    trust: Trust
    inflight: InFlight
    injector: Injector
    decode: DecodeWatch
    routing: Callable[[Admission], RouterMode] | None = None  # router mode, built on the proxy's admission
    tracing: Tracing = OFF


class Proxy:
    """The proxy's ASGI handler for ``http`` scopes."""

    def __init__(self, config: Config, parts: ProxyParts) -> None:
        judge = Judge(config, parts.pipeline, parts.metrics, parts.inflight, parts.decode, parts.tracing)
        inspector = Inspector(parts.metrics, parts.trust, parts.pipeline.releaser.keeps_raw)
        answers = STYLES[config.answers]  # the style of the sidecar's own answers, picked once
        forwarder = Forwarder(parts.upstream, judge, parts.metrics, parts.tracing, answers)
        refusals = Refusals(config, inspector, judge, forwarder, parts.metrics)
        self.kit = Collaborators(
            config,
            parts.metrics,
            parts.tracing,
            parts.trust,
            parts.injector,
            inspector,
            forwarder,
            refusals,
            answers,
        )
        self.admission = Admission(self.kit)
        self.pipeline = parts.pipeline
        self.router = parts.routing(self.admission) if parts.routing is not None else None

    @property
    def stopping(self) -> bool:
        return self.kit.refusals.stopping

    @stopping.setter
    def stopping(self, value: bool) -> None:
        """Set once the drain began: new inspected requests are refused (503) and released."""
        self.kit.refusals.stopping = value

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        ctx = RequestContext.of(scope, receive, send)
        tracing, metrics = self.kit.tracing, self.kit.metrics
        metrics.requests_in_flight += 1
        try:
            if ctx.route is not None and tracing.enabled:
                with tracing.server_span(scope) as span:
                    ctx.send = span.watch(send)
                    await self._handle(ctx)
            else:
                await self._handle(ctx)
        except asyncio.CancelledError:
            # uvicorn cancels what still runs past drain_timeout at shutdown (a client's own
            # disconnect is handled where it happens). Answer in vLLM's shape if nothing was
            # sent yet, instead of uvicorn's plain-text 500 and a logged traceback.
            uncancel()
            await _answer_if_unanswered(send, 503, SHUTTING_DOWN, ctx.request_id)
        finally:
            metrics.requests_in_flight -= 1
            # The relay holds the server's cycle, which holds this scope: dropped, the request's
            # objects are freed as it ends rather than left to the garbage collector as a cycle.
            scope.pop(RELAY, None)

    async def _handle(self, ctx: RequestContext) -> None:
        kit = self.kit
        router = self.router if self.router is not None and self.router.routes(ctx) else None
        policy = router.policy if router is not None else SIDECAR  # the mode of this request
        if over_limit(ctx.scope):
            await kit.refusals.over_limit(ctx, policy)
            return
        if ctx.route is None:
            await kit.forwarder.passthrough(ctx)
            return
        try:
            body = await read_body(ctx.receive, kit.config.max_body_bytes, kit.refusals.scan_limit)
        except ClientGone:
            # Without the whole body there are no trustworthy parameters to release.
            kit.forwarder.count(ctx.route, -1)
            return
        if isinstance(body, Oversized):
            await kit.refusals.too_large(ctx, body, policy)
        elif router is not None:
            await router.route(ctx, body)
        else:
            await self._inspected(ctx, body)

    async def _inspected(self, ctx: RequestContext, body: bytes) -> None:
        """Sidecar mode: the client's own parameters, checked, then the request to D."""
        kit = self.kit
        exchange = kit.inspector.inspected(ctx, body)
        spent = exchange.params is not None and self.pipeline.holds(exchange.key)
        if spent and await kit.refusals.replay(ctx, exchange):
            return
        await self.admission.admit(ctx, exchange, ctx.headers, body)


async def _answer_if_unanswered(send: Send, status: int, message: str, request_id: str) -> None:
    """An error answer unless a response already started (uvicorn refuses a second start);
    bounded, so a client that reads nothing cannot hold the shutdown."""
    with contextlib.suppress(RuntimeError, TimeoutError):
        async with asyncio.timeout(1.0):
            await send_error(send, status, message, request_id)
