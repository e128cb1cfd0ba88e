"""How one mode reads an exchange's fate: the sidecar's, or the router's.

Sidecar mode reads it as ``sidecar.classify`` says. Router mode holds P's
parameters itself: it releases what it aborted (``ROUTER_RELEASES``), and
with ``decode_releases`` leaves D's answers to the decode sidecar.
"""

from __future__ import annotations

from dataclasses import dataclass

from sidecar.classify import ROUTER_RELEASES, Cause, Decision, Event, Failure, Outcome
from sidecar.observability.metrics import Metrics


@dataclass(frozen=True, slots=True)
class Policy:
    """How one mode reads an exchange's fate. Sidecar mode: as ``classify`` says."""

    router: bool = False
    decode_releases: bool = False  # router mode: a decode sidecar judges D's answers itself

    def decide(self, decision: Decision, event: Event) -> Decision:
        if not self.router:
            return decision
        if self.decode_releases and event.failure is None:
            # D's answer came back through the decode sidecar, which judged it and released what it
            # had to: releasing here too would notify P twice.
            return Decision(Outcome.NO_RELEASE, Cause.DELEGATED)
        if decision.cause in ROUTER_RELEASES:
            # The router holds P's parameters and closed its connection to D: D aborts the request.
            return Decision(Outcome.RELEASE, decision.cause)
        return decision

    def decode_answered(self, metrics: Metrics, status: int, elapsed: float) -> None:
        """The decode leg's answer (router mode counts its legs)."""
        if self.router:
            metrics.leg_latency.labels("decode").observe(elapsed)
            if status >= 400:
                metrics.leg_failures.labels("decode", f"status_{status // 100}xx").inc()

    def decode_failed(self, metrics: Metrics, failure: Failure) -> None:
        if self.router:
            metrics.leg_failures.labels("decode", failure.value).inc()

    def retried_elsewhere(self, answer: int | None, retried: frozenset[int]) -> bool:
        """Whether a proxy in front may resend this request, P's parameters and all, to another
        decode pod (sidecar mode). A router's client retries with a fresh prefill."""
        return not self.router and answer in retried

    @property
    def spends(self) -> bool:
        """A released request's parameters are spent for the client (sidecar mode); a router's
        client retries with a fresh prefill."""
        return not self.router


SIDECAR = Policy()
