"""Router mode with two P (TP 2, vLLM 0.33.0) and one vLLM-D-mode D: spread, release, failover, responses."""

from __future__ import annotations

import asyncio
import threading

import httpx
import pytest

from sidecar.sim.servers import ServerThread
from tests.support.runner import Sidecar
from tests.support.sims import completion, p_stats, pd, wait_stats
from tests.support.until import until_async

pytestmark = pytest.mark.nixl


def prefill_failures(sc: Sidecar) -> float:
    """``kvr_leg_failures_total{leg="prefill"}`` summed over causes."""
    return sum(
        sample.value
        for metric in sc.registry.collect()
        for sample in metric.samples
        if sample.name == "kvr_leg_failures_total" and sample.labels.get("leg") == "prefill"
    )


def spread(sc: Sidecar, p1: ServerThread, later: int) -> list[int]:
    """One request held on p1 (its event loop blocked), then ``later`` requests one after another.

    Least-outstanding sends each later request to the P with fewer legs in flight: p2.
    """
    router = sc.app.runtime.proxy.router.pool if sc.app.runtime and sc.app.runtime.proxy.router else None
    assert router is not None and p1.loop is not None
    gate = threading.Event()

    async def hold_p1() -> None:
        gate.wait(10)  # blocks p1's loop on purpose: its prefill legs stay outstanding

    async def send() -> list[int]:
        async with httpx.AsyncClient(timeout=10) as client:
            first = asyncio.create_task(client.post(sc.url + "/v1/completions", json=completion(5)))
            await until_async(
                lambda: router.outstanding.get(p1.url, 0) or first.done(), "the first leg at p1", 5.0, 0.002
            )
            assert not first.done(), "the first leg never reached p1"
            codes = [(await client.post(sc.url + "/v1/completions", json=completion(5))).status_code]
            for _ in range(later - 1):
                codes.append((await client.post(sc.url + "/v1/completions", json=completion(5))).status_code)
            gate.set()
            return [(await first).status_code, *codes]

    held = asyncio.run_coroutine_threadsafe(hold_p1(), p1.loop)
    try:
        return asyncio.run(send())
    finally:
        gate.set()
        held.result(10)


def test_admitted_requests_spread_over_both_p_and_d_frees_every_one() -> None:
    with pd(2) as (ps, _d, sc):
        assert spread(sc, ps[0], 7) == [200] * 8
        after = [wait_stats(p, lambda s: s["pinned_requests"] == 0) for p in ps]
        served = [s["requests_pinned"] for s in after]
        assert served == [1, 7], served
        for s in after:
            assert s["freed_by_notification"] == s["requests_pinned"]  # D's notification freed each one
            assert s["notifs_per_rank"] == [s["requests_pinned"]] * 2
            assert s["notifs_unknown"] == 0 and s["freed_by_expiry"] == 0
        sc.settle()
        assert sc.sample("kvr_releases_total", strategy="nixl", result="sent") == 0  # none needed the sidecar


def test_d_rejection_frees_every_rank_of_the_p_that_served_it() -> None:
    with pd(2) as (ps, _d, sc):
        response = httpx.post(sc.url + "/v1/completions", json=completion(5, max_tokens="x"))
        assert response.status_code == 400
        after = [wait_stats(p, lambda s: s["pinned_requests"] == 0) for p in ps]
        [served] = [s for s in after if s["requests_pinned"] == 1]
        assert sum(s["requests_pinned"] for s in after) == 1
        assert served["notifs_per_rank"] == [1, 1] and served["rank_finished_by_notification"] == [1, 1]
        assert served["notifs_unknown"] == 0
        sc.settle()
        assert sc.sample("kvr_releases_total", strategy="nixl", result="sent") == 1


def test_a_stopped_p_fails_over_to_the_other_and_is_skipped_during_the_backoff() -> None:
    with pd(2, prefill_backoff=60.0) as ([p1, p2], _d, sc):
        # least-outstanding with nothing in flight keeps the static order: p1 first
        assert httpx.post(sc.url + "/v1/completions", json=completion(5)).status_code == 200
        assert wait_stats(p1, lambda s: s["pinned_requests"] == 0)["freed_by_notification"] == 1
        assert p_stats(p2)["requests_pinned"] == 0
        ServerThread.stop(p1)
        for _ in range(6):
            assert httpx.post(sc.url + "/v1/completions", json=completion(5)).status_code == 200
        assert prefill_failures(sc) == 1  # only the first request after the stop tried p1
        after = wait_stats(p2, lambda s: s["pinned_requests"] == 0)
        assert after["requests_pinned"] == 6 and after["freed_by_notification"] == 6


def test_responses_through_the_router_returns_p_s_error_unchanged_and_d_never_sees_it() -> None:
    body = {"model": "m", "input": "hello there", "max_output_tokens": 4}
    with pd(2) as (ps, d, sc):
        direct = httpx.post(ps[0].url + "/v1/responses", json=body)
        assert direct.status_code == 404  # sim-prefill serves no /v1/responses
        response = httpx.post(sc.url + "/v1/responses", json=body)
        assert response.status_code == direct.status_code
        assert response.content == direct.content
        assert httpx.get(d.url + "/sim/log").json() == []
        assert prefill_failures(sc) == 0  # a 4xx is P's answer, not a failed leg: no failover
        for p in ps:
            assert p_stats(p)["requests_pinned"] == 0
