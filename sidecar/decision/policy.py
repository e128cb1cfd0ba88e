"""How one mode reads an exchange's fate: two values, ``SIDECAR`` and ``router_policy(...)``.

Sidecar mode reads it as ``sidecar.classify`` says, and a proxy in front may
resend a refused request, parameters and all, to another decode pod. Router
mode holds P's parameters itself: it releases what it aborted
(``ROUTER_RELEASES``), with ``decode_releases`` leaves D's answers to the
decode sidecar, counts its decode leg, and its client retries with a fresh
prefill (nothing is spent, nothing is retried in front with P's parameters).
"""

from __future__ import annotations

from dataclasses import dataclass

from sidecar.classify import ROUTER_RELEASES, Cause, Decision, Event, NoAnswer, Outcome
from sidecar.observability.metrics import Metrics


@dataclass(frozen=True, slots=True)
class Policy:
    """How one mode reads an exchange's fate (see the module docstring); picked once per mode."""

    name: str
    releases: frozenset[Cause] = frozenset()  # released whatever classify says: the mode's own aborts
    delegates: bool = False  # D's answers come through a decode sidecar, which judges them itself
    retried_in_front: bool = True  # a proxy in front may resend the request to another decode pod
    spends_params: bool = True  # a released request's parameters are spent for the client
    leg: str | None = None  # the leg its answers from D are counted under (kvr_leg_*)
    # The client's own kv_transfer_params are read (sidecar mode); router mode drops them: they
    # could name any P's blocks, and the router sends P's own on the decode leg.
    client_params: bool = True

    def decide(self, decision: Decision, event: Event) -> Decision:
        if self.delegates and event.failure is None:
            # D's answer came back through the decode sidecar, which judged it and released what it
            # had to: releasing here too would notify P twice.
            return Decision(Outcome.NO_RELEASE, Cause.DELEGATED)
        if decision.cause in self.releases:
            # The router holds P's parameters and closed its connection to D: D aborts the request.
            return Decision(Outcome.RELEASE, decision.cause)
        return decision

    def decode_answered(self, metrics: Metrics, status: int, elapsed: float) -> None:
        """The decode leg's answer (router mode counts its legs)."""
        if self.leg is not None:
            metrics.leg_latency_for(self.leg).observe(elapsed)
            if status >= 400:
                metrics.leg_failures.labels(self.leg, f"status_{status // 100}xx").inc()

    def decode_failed(self, metrics: Metrics, failure: NoAnswer) -> None:
        if self.leg is not None:
            metrics.leg_failures.labels(self.leg, failure.value).inc()

    def retried_elsewhere(self, answer: int | None, retried: frozenset[int]) -> bool:
        """Whether a proxy in front may resend this request, P's parameters and all, to another
        decode pod (sidecar mode). A router's client retries with a fresh prefill."""
        return self.retried_in_front and answer in retried


#: Sidecar mode: the client's own parameters, judged as ``classify`` says.
SIDECAR = Policy("sidecar")


def router_policy(decode_releases: bool = False) -> Policy:
    """Router mode; ``decode_releases``: a decode sidecar judges D's answers itself."""
    return Policy(
        "router",
        releases=ROUTER_RELEASES,
        delegates=decode_releases,
        retried_in_front=False,
        spends_params=False,
        leg="decode",
        client_params=False,
    )


#: Router mode without a decode sidecar.
ROUTER = router_policy()
