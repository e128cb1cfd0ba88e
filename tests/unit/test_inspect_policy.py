"""The request's mode, a ``Policy`` value, decides whether a client's own parameters are read."""

from __future__ import annotations

import json

import pytest
from prometheus_client import CollectorRegistry

from sidecar.config import Config
from sidecar.decision.policy import SIDECAR, Policy, router_policy
from sidecar.observability.metrics import Metrics
from sidecar.proxy.body import Oversized
from sidecar.proxy.context import RequestContext
from sidecar.proxy.inspect import Inspector
from sidecar.proxy.trust import Trust
from tests.unit.test_proxy import V033


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
