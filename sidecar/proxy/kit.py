"""The request path's collaborators, made once by ``Proxy`` and shared with the router.

``Routed`` is the router's side of the seam: the app builds it from the ``Kit``
(``ProxyParts.routing``), so the request path never imports router mode.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from sidecar.config import Config
from sidecar.decision.judge import Judge
from sidecar.observability.metrics import Metrics
from sidecar.observability.tracing import Tracing
from sidecar.proxy.context import RequestContext
from sidecar.proxy.forward import Forwarder
from sidecar.proxy.inject import Injector
from sidecar.proxy.inspect import Inspector
from sidecar.proxy.refusals import Refusals
from sidecar.proxy.trust import Trust


@dataclass(frozen=True, slots=True)
class Kit:
    config: Config
    metrics: Metrics
    tracing: Tracing
    trust: Trust
    injector: Injector
    inspector: Inspector
    judge: Judge
    forwarder: Forwarder
    refusals: Refusals


class Routed(Protocol):
    """Router mode as the proxy sees it (``sidecar.router.legs.Router``)."""

    def routes(self, ctx: RequestContext) -> bool:
        """Whether this request takes the router's path."""

    async def route(self, ctx: RequestContext, body: bytes) -> None:
        """Run the prefill leg, then the decode leg, and answer the client."""

    async def close(self) -> None:
        """Release what router mode holds (its connections to P)."""
