"""A retrying proxy in front of two decode pods never makes a D read blocks a sidecar freed.

Two decode pods, each a sidecar (``--release nixl``, default
``retried_statuses``) in front of its D, share one P (the prefill simulator,
vLLM 0.34.0, TP 2, pins that never expire). In front of both: Debian's nginx
or haproxy running ``deploy/mesh``'s configuration as shipped, retrying a
503 on the other pod with the same body, P's ``kv_transfer_params`` and all.
Pod 1 fails in one of three ways (its D down, its D answering a
pre-admission 503, its sidecar draining); pod 2 admits and reads.

Judged from P's own record: every request is freed exactly once, by one
notification per rank, and P saw no notification for an id it no longer held
(what a D reading freed blocks sends). Pod 1's sidecar released nothing: it
left each failure to the retry (``kvr_not_released_total{outcome="retryable"}``).
A control runs pod 1 with ``retried_statuses = none`` and must show the wrong
release; another has both pods refuse, and P keeps the blocks (its lease
frees them: 30 s from vLLM 0.22.0, 480 s before).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any, Literal

import httpx
import pytest

from sidecar.config import Config
from sidecar.sim.decode import create_decode_app
from sidecar.sim.decode.config import DecodeSimConfig
from sidecar.sim.servers import serve
from tests.faults.cluster import MODEL, TP, VERSION, Backends, Flows, Sent, sidecar
from tests.faults.fronts import Kind, front
from tests.support.ports import free_port
from tests.support.runner import Sidecar
from tests.support.until import until

pytestmark = pytest.mark.nixl

Failure = Literal["d_down", "d_503", "draining"]
REQUESTS = 6  # sequential: round-robin sends about half to pod 1 first
DEFAULT = {"retried_statuses": Config().retried_statuses}  # the shipped default, 502, 503, 504


def _p(cluster: Backends, path: str) -> Any:
    return httpx.get(cluster.p.url + path, timeout=5).json()


def _unknown(cluster: Backends) -> int:
    return int(_p(cluster, "/stats")["notifs_unknown"])


@contextmanager
def _pod_one_d(cluster: Backends, failure: Failure) -> Iterator[str]:
    """Pod 1's D: nothing listening, a D whose scaling middleware answers 503, or the shared D."""
    if failure == "d_down":
        yield f"http://127.0.0.1:{free_port()}"
    elif failure == "d_503":
        config = DecodeSimConfig(port=0, version=VERSION, model=MODEL, scaling=True)
        with serve(create_decode_app(config)) as d:
            yield d.url
    else:
        yield cluster.d.url


@contextmanager
def _pods(cluster: Backends, failure: Failure, **pod_one: Any) -> Iterator[tuple[Sidecar, Sidecar]]:
    with ExitStack() as stack:
        d_one = stack.enter_context(_pod_one_d(cluster, failure))
        one = stack.enter_context(sidecar(d_one, **{**DEFAULT, **pod_one}))
        two = stack.enter_context(sidecar(cluster.d.url, **DEFAULT))
        if failure == "draining":
            assert one.app.runtime is not None
            one.app.runtime.proxy.stopping = True
        yield one, two


def _hostport(sc: Sidecar) -> str:
    return sc.server.url.removeprefix("http://")


def _freed_once(cluster: Backends, sent: Sent) -> bool:
    record = _p(cluster, f"/sim/requests/{sent.p_request_id}")
    return bool(record and record["freed_by"] == "notification" and record["notification_counts"] == [1] * TP)


def _send(cluster: Backends, url: str, count: int = REQUESTS) -> list[Sent]:
    flows = Flows(cluster, "mesh")
    try:
        return [flows.decode(url, "admit") for _ in range(count)]
    finally:
        flows.close()


def _sent(sc: Sidecar) -> float:
    return sc.sample("kvr_releases_total", strategy="nixl", result="sent")


def _left_to_retry(sc: Sidecar) -> float:
    return sum(
        sc.sample("kvr_not_released_total", outcome="retryable", cause=cause)
        for cause in ("unreachable", "rejected_5xx", "shutting_down")
    )


@pytest.mark.parametrize("failure", ["d_down", "d_503", "draining"])
@pytest.mark.parametrize("kind", ["nginx", "haproxy"])
def test_a_retry_on_the_other_pod_reads_blocks_no_sidecar_freed(
    cluster: Backends, kind: Kind, failure: Failure
) -> None:
    unknown = _unknown(cluster)
    with _pods(cluster, failure) as (one, two), front(kind, [_hostport(one), _hostport(two)]) as url:
        sent = _send(cluster, url)
        assert [x.status for x in sent] == [200] * REQUESTS, [x.body[:200] for x in sent]
        hits = _left_to_retry(one)
        assert hits >= 1, "no request reached pod 1 first: the scenario tested nothing"
        until(lambda: all(_freed_once(cluster, x) for x in sent), "each request freed once by D's read")
        assert one.wait_idle() and two.wait_idle()
        assert one.sample("kvr_releases_total", strategy="nixl", result="sent") == 0
        assert two.sample("kvr_releases_total", strategy="nixl", result="sent") == 0
    assert _unknown(cluster) == unknown, "a D read blocks P had freed"


def test_control_releasing_behind_a_retried_503_is_a_wrong_release(cluster: Backends) -> None:
    """Pod 1 told nothing in front retries (``retried_statuses = none``) while nginx does: pod 1
    frees P's blocks, nginx retries on pod 2, whose D reads them. P sees the unknown-id
    notification this file's other tests must never produce."""
    unknown = _unknown(cluster)
    pods = _pods(cluster, "d_down", retried_statuses=("none",))
    with pods as (one, two), front("nginx", [_hostport(one), _hostport(two)]) as url:
        sent = _send(cluster, url)
        assert [x.status for x in sent] == [200] * REQUESTS
        until(lambda: _sent(one) >= 1, "pod 1's releases")  # the release goes after the answer
        until(lambda: _unknown(cluster) - unknown >= 1, "P's unknown-id notifications")
        assert one.wait_idle()
        until(lambda: _unknown(cluster) - unknown >= _sent(one), "one unknown id per release")


def test_when_every_pod_refuses_nobody_releases_and_p_keeps_the_blocks(cluster: Backends) -> None:
    """Both pods' D down: nginx tries both, the client gets 503, and neither sidecar frees the
    blocks (a proxy could still retry). P holds them until its lease."""
    with ExitStack() as stack:
        one = stack.enter_context(sidecar(f"http://127.0.0.1:{free_port()}", **DEFAULT))
        two = stack.enter_context(sidecar(f"http://127.0.0.1:{free_port()}", **DEFAULT))
        url = stack.enter_context(front("nginx", [_hostport(one), _hostport(two)]))
        [refused] = _send(cluster, url, count=1)
        assert refused.status == 503 and b"x-should-retry" not in refused.body
        assert _left_to_retry(one) + _left_to_retry(two) == 2  # each pod tried once
        assert one.wait_idle() and two.wait_idle()
        record = _p(cluster, f"/sim/requests/{refused.p_request_id}")
        assert record["pinned"] and record["notification_counts"] == [0] * TP
