"""TODO docstring."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry

from sidecar.config import Config
from sidecar.decision.judge import InFlight, Judge
from sidecar.decision.policy import SIDECAR, Policy
from sidecar.observability.metrics import Metrics
from sidecar.observability.tracing import Tracing
from sidecar.proxy.context import Exchange
from sidecar.release.base import ReleaseJob
from sidecar.upstream.client import Sent
from tests.support.fakes import FakeDecode, release_params
from tests.unit.rigs import V033

PARAMS = release_params(V033)


class Frees:
    """The strategy as the judge sees it: one that frees P's blocks."""

    frees = True
    checked = True


class Queue:
    """The pipeline's seam: ``submit`` records each job and answers ``queued``."""

    def __init__(self, queued: bool = True, releaser: object = None) -> None:
        self.releaser, self.jobs, self.queued = releaser or Frees(), list[ReleaseJob](), queued

    def submit(self, job: ReleaseJob) -> bool:
        self.jobs.append(job)
        return self.queued


class Traces(Tracing):
    """Tracing on: every decision as (outcome, cause, what became of the blocks)."""

    enabled = True

    def __init__(self) -> None:
        self.decisions: list[tuple[str, str, str]] = []

    def decided(self, outcome: str, cause: str, release: str) -> None:
        self.decisions.append((outcome, cause, release))

    def job_context(self) -> Any:
        return "the request's span"


class Rig:
    def __init__(
        self, queued: bool = True, decode: FakeDecode | None = None, releaser: object = None, **settings: Any
    ) -> None:
        self.config = Config(**{"release": "nixl", "may_cover_delay": 0.05, **settings})
        self.queue, self.inflight, self.traces = Queue(queued, releaser), InFlight(100, 30), Traces()
        self.decode = decode or FakeDecode(None)  # D's release unknown: no engine coverage unless asked
        self.metrics = Metrics(CollectorRegistry())
        self.judge = Judge(self.config, self.queue, self.metrics, self.inflight, self.decode, self.traces)  # type: ignore[arg-type]

    def sample(self, name: str, **labels: str) -> float:
        return self.metrics.registry.get_sample_value(name, labels) or 0.0


def exchange(policy: Policy = SIDECAR, *, sent: bool = True, **fields: Any) -> Exchange:
    values: dict[str, Any] = {
        "request_id": "req-1",
        "route": "/v1/completions",
        "params": PARAMS,
        "stream": False,
        "started": 0.0,
        "policy": policy,
        **fields,
    }
    made = Exchange(**values)
    made.sent = Sent() if sent else None
    return made
