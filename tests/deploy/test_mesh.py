"""The retry policies ``deploy/mesh`` ships agree with the sidecar they sit in front of.

Each file (the Istio ``VirtualService``, the Envoy route, nginx, haproxy) may
retry a request on another decode pod only where the sidecar leaves the
blocks to that retry: connection failures, and statuses in the shipped
sidecar's ``retried_statuses``. None may retry on a reset, a timeout, 502 or
504 (D may have admitted the request: a second D would read blocks the first
may free), nor set a per-try timeout. The nginx and haproxy files also run as
shipped in ``tests/faults/test_mesh_retries.py``.
"""

from __future__ import annotations

import re

import pytest
import yaml

from sidecar import retries
from tests.deploy.manifests import DEPLOY, effective_config, of_kind, pods, rendered

MESH = DEPLOY / "mesh"
NEVER = {"reset", "5xx", "gateway-error", "retriable-4xx", "timeout", "response-timeout", "empty-response"}


def _retried_by_the_sidecar() -> frozenset[int]:
    resources = rendered("sidecar")
    (pod,) = [p for p in pods(resources) if p.vllm() and p.sidecars()]
    return retries.parse(effective_config(resources, pod, pod.sidecars()[0]).retried_statuses)


def _judge(conditions: set[str], statuses: set[int]) -> None:
    assert conditions, "no retry condition: the file retries nothing"
    assert not conditions & NEVER, f"retries what D may have admitted: {conditions & NEVER}"
    assert statuses, "retries no status: a D-down 503 fails over nowhere"
    assert statuses <= _retried_by_the_sidecar(), f"{statuses} are released behind by the sidecar"
    assert not statuses & {502, 504}


def test_istio_virtualservice() -> None:
    (service,) = of_kind(rendered("mesh/istio"), "VirtualService")
    (route,) = service["spec"]["http"]
    policy = route["retries"]
    assert "perTryTimeout" not in policy and "timeout" not in route
    words = set(policy["retryOn"].split(","))
    codes = {int(w) for w in words if w.isdigit()}
    _judge(words - {str(c) for c in codes} - {"retriable-status-codes"}, codes)
    hosts = {s["metadata"]["name"] for s in of_kind(rendered("sidecar"), "Service")}
    assert route["route"][0]["destination"]["host"] in hosts


def test_envoy_route() -> None:
    config = yaml.safe_load((MESH / "envoy-decode-route.yaml").read_text())
    (host,) = config["virtual_hosts"]
    (route,) = host["routes"]
    policy = route["route"]["retry_policy"]
    assert "per_try_timeout" not in policy and route["route"]["timeout"] == "0s"
    words = set(policy["retry_on"].split(","))
    assert "retriable-status-codes" in words
    _judge(words - {"retriable-status-codes"}, set(policy["retriable_status_codes"]))
    predicates = [p["name"] for p in policy["retry_host_predicate"]]
    assert predicates == ["envoy.retry_host_predicates.previous_hosts"]  # another pod


def test_nginx() -> None:
    text = (MESH / "nginx-decode.conf").read_text()
    (line,) = re.findall(r"^\s*proxy_next_upstream\s+([^;]+);", text, re.M)
    words = set(line.split())
    assert "non_idempotent" in words  # POST is retried only with it
    codes = {int(w.removeprefix("http_")) for w in words if w.startswith("http_")}
    _judge(words - {"non_idempotent"} - {f"http_{c}" for c in codes}, codes)


def test_haproxy() -> None:
    text = (MESH / "haproxy-decode.cfg").read_text()
    (line,) = re.findall(r"^\s*retry-on\s+(.+)$", text, re.M)
    words = set(line.split())
    assert "all-retryable-errors" not in words
    assert re.search(r"^\s*option http-buffer-request\s*$", text, re.M)  # without it, no retry
    codes = {int(w) for w in words if w.isdigit()}
    _judge(words - {str(c) for c in codes}, codes)


@pytest.mark.parametrize("bad", ["reset", "5xx", "gateway-error"])
def test_control_a_policy_retrying_what_d_may_have_admitted_fails(bad: str) -> None:
    with pytest.raises(AssertionError):
        _judge({"connect-failure", bad}, {503})
    with pytest.raises(AssertionError):
        _judge({"connect-failure"}, {503, 500})  # 500 is released behind by default
