"""The request path's collaborators, made once by ``Proxy`` and shared with the router."""

from __future__ import annotations

from dataclasses import dataclass

from sidecar.config import Config
from sidecar.faults import Injector
from sidecar.metrics import Metrics
from sidecar.proxy.forward import Forwarder
from sidecar.proxy.inspect import Inspector
from sidecar.proxy.judge import Judge
from sidecar.proxy.refusals import Refusals
from sidecar.tracing import Tracing
from sidecar.trust import Trust


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
