"""The request's mode, a ``Policy`` value, decides whether a client's own parameters are read."""

from __future__ import annotations

import json

import pytest
from prometheus_client import CollectorRegistry

from sidecar.config import Config
from sidecar.decision.policy import SIDECAR, Policy, router_policy
from sidecar.observability.metrics import Metrics
from sidecar.proxy.context import Inspector, Oversized, RequestContext
from sidecar.proxy.trust import Trust
from tests.unit.rigs import V033


async def _never() -> dict[str, object]:
    raise AssertionError("not read")


async def _ignore(message: dict[str, object]) -> None:
    raise AssertionError("not sent")


def _oversized(policy: Policy) -> bool:
    """Whether an over-cap body's trailing parameters are kept under ``policy``."""
    inspector = Inspector(Metrics(CollectorRegistry()), Trust(Config(trust="any")), keeps_raw=False)
    scope = {
        "type": "http",
        "method": "POST",
        "path": "/v1/completions",
        "headers": [(b"x-request-id", b"r-1")],
    }
    ctx = RequestContext.of(scope, _never, _ignore)  # type: ignore[arg-type]
    tail = b'"x"], "kv_transfer_params": ' + json.dumps(V033).encode() + b"}"
    exchange = inspector.oversized(ctx, Oversized(size=10**9, tail=tail, complete=True), policy)
    return exchange.params is not None


@pytest.mark.parametrize(
    ("decode_releases", "kept"),
    [(None, True), (False, False), (True, False)],
    ids=["sidecar", "router", "router-with-decode-sidecar"],
)
def test_only_sidecar_mode_reads_the_clients_parameters(decode_releases: bool | None, kept: bool) -> None:
    policy = SIDECAR if decode_releases is None else router_policy(decode_releases)  # made in the test
    assert policy.client_params is kept
    assert _oversized(policy) is kept


def _inspected(
    config: Config, headers: list[tuple[bytes, bytes]] | None = None
) -> tuple[bool, bool, Metrics]:
    """(kept, vouched, metrics) for a request carrying the client's own parameters under ``config``."""
    metrics = Metrics(CollectorRegistry())
    inspector = Inspector(metrics, Trust(config), keeps_raw=False)
    scope = {
        "type": "http",
        "method": "POST",
        "path": "/v1/completions",
        "headers": [(b"x-request-id", b"r-1"), *(headers or [])],
    }
    ctx = RequestContext.of(scope, _never, _ignore)  # type: ignore[arg-type]
    exchange = inspector.inspected(ctx, json.dumps({"prompt": "x", "kv_transfer_params": V033}).encode())
    return exchange.params is not None, exchange.vouched, metrics


def _dropped(metrics: Metrics) -> float:
    value = metrics.registry.get_sample_value("kvr_ineligible_total", {"reason": "client_params_dropped"})
    return value or 0.0


@pytest.mark.parametrize("allow", [(), ("10.0.0.0/8",)])
def test_pd_sidecar_drops_the_clients_parameters_whatever_the_allowlist(allow: tuple[str, ...]) -> None:
    config = Config(release_client_params=False, prefill_allow_default="routable", prefill_allow=allow)
    kept, _, metrics = _inspected(config)
    assert not kept and _dropped(metrics) == 1


def test_only_ps_answer_and_parameters_the_router_hop_vouched_for_are_vouched() -> None:
    inspector = Inspector(Metrics(CollectorRegistry()), Trust(Config()), keeps_raw=False)
    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": []}
    ctx = RequestContext.of(scope, _never, _ignore)  # type: ignore[arg-type]
    assert inspector.prefilled(ctx, json.dumps(V033).encode(), None, router_policy()).vouched
    assert _inspected(Config(trust="any"))[:2] == (True, False)
    token = [(b"x-kvr-router-token", b"s3cret")]
    assert _inspected(Config(trust="token", trust_token="s3cret"), token)[:2] == (True, True)
    assert _inspected(Config(trust="token", trust_token="s3cret"))[:2] == (False, False)
