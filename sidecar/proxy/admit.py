"""The proxy's one public step for a request on its way to D, and router mode's seam.

``Admission.admit`` is the gate every inspected request passes once its
parameters are known: refused while the sidecar drains (503, released), an
injected rejection (load tests), else forwarded to D and judged. The
sidecar path calls it after its replay check (``sidecar.proxy.dispatch``);
router mode calls it for its decode leg (``sidecar.router.legs``) and uses
nothing else of the proxy but the few steps ``Admission`` offers beside it.
``RouterMode`` is router mode as the proxy sees it: the app builds it on the
proxy's ``Admission`` (``ProxyParts.routing``), so the request path never
imports router mode.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from sidecar.classify import Event, NoAnswer
from sidecar.config import Config
from sidecar.decision.policy import Policy
from sidecar.observability.metrics import Metrics
from sidecar.observability.tracing import Tracing
from sidecar.proxy.answers import AnswerStyle
from sidecar.proxy.context import Exchange, RequestContext
from sidecar.proxy.disconnect import DisconnectWatcher
from sidecar.proxy.forward import Forwarder
from sidecar.proxy.inject import Injector
from sidecar.proxy.inspect import Inspector
from sidecar.proxy.refusals import SHUTTING_DOWN, Refusals
from sidecar.proxy.trust import Trust
from sidecar.proxy.usage import UsageRewriter


@dataclass(frozen=True, slots=True)
class Collaborators:
    """The request path's collaborators, made once by ``Proxy``."""

    config: Config
    metrics: Metrics
    tracing: Tracing
    trust: Trust
    injector: Injector
    inspector: Inspector
    forwarder: Forwarder
    refusals: Refusals
    answers: AnswerStyle


class Admission:
    """The gate to D and the steps router mode takes through the proxy (module docstring)."""

    __slots__ = ("_parts",)

    def __init__(self, parts: Collaborators) -> None:
        self._parts = parts

    @property
    def config(self) -> Config:
        return self._parts.config

    @property
    def metrics(self) -> Metrics:
        return self._parts.metrics

    @property
    def tracing(self) -> Tracing:
        return self._parts.tracing

    @property
    def answers(self) -> AnswerStyle:
        """The style of the sidecar's own answers, picked at start."""
        return self._parts.answers

    async def admit(
        self,
        ctx: RequestContext,
        exchange: Exchange,
        headers: list[tuple[str, str]],
        body: bytes,
        watcher: DisconnectWatcher | None = None,
    ) -> None:
        """Refused while draining, an injected rejection, else to D: answered and judged."""
        parts = self._parts
        if parts.refusals.stopping:
            if watcher is not None:
                watcher.stop()
            await parts.refusals.refuse(ctx, exchange, NoAnswer.SHUTTING_DOWN, SHUTTING_DOWN)
            return
        if parts.injector.enabled:
            assert ctx.route is not None
            status = parts.injector.status_for(ctx.route, ctx.headers_read, exchange.params is not None)
            if status is not None:
                if watcher is not None:
                    watcher.stop()
                await parts.refusals.inject(ctx, exchange, status)
                return
        await parts.forwarder.forward(ctx, exchange, headers, body, watcher)

    async def alone(
        self, ctx: RequestContext, stream: bool, headers: list[tuple[str, str]], body: bytes
    ) -> None:
        """To D without parameters (D prefills itself, or answers a body that is no JSON object)."""
        parts = self._parts
        await parts.forwarder.forward(ctx, parts.inspector.plain(ctx, stream), headers, body)

    def prefilled(
        self,
        ctx: RequestContext,
        raw: bytes | None,
        rewriter: UsageRewriter | None,
        policy: Policy,
        answered: float | None,
    ) -> Exchange:
        """Router mode: the decode leg's exchange, with P's own parameters as JSON (``raw``,
        ``Inspector.prefilled``)."""
        return self._parts.inspector.prefilled(ctx, raw, rewriter, policy, answered)

    def abandoned(self, exchange: Exchange) -> None:
        """The client left before the request went to D: released, counted as gone."""
        self._parts.forwarder.judged(exchange, Event(failure=NoAnswer.CLIENT_GONE_BEFORE_FORWARD))
        self.count(exchange.route, -1)

    def unsent(self, exchange: Exchange) -> None:
        """P's answer was over ``prefill_answer_limit``: no decode leg goes to D, so it is released."""
        self._parts.forwarder.judged(exchange, Event(failure=NoAnswer.PREFILL_ANSWER_TOO_LARGE))

    def count(self, route: str, status: int) -> None:
        """``kvr_requests_total`` for one answer (``status`` < 0: the client left)."""
        self._parts.forwarder.count(route, status)

    def sign(self, request_id: str, raw: bytes) -> list[tuple[str, str]]:
        """Headers that vouch for parameters the sidecar sends on (``Trust.outgoing``)."""
        return self._parts.trust.outgoing(request_id, raw)


class RouterMode(Protocol):
    """Router mode as the proxy sees it (``sidecar.router.legs.Router``)."""

    policy: Policy  # router mode's, picked once

    def routes(self, ctx: RequestContext) -> bool:
        """Whether this request takes the router's path."""

    async def route(self, ctx: RequestContext, body: bytes) -> None:
        """Run the prefill leg, then the decode leg, and answer the client."""

    async def close(self) -> None:
        """Release what router mode holds (its connections to P)."""
