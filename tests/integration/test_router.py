"""Router mode: prefill on P, decode on D, release when D rejects (real simulators, real NIXL)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest

from sidecar.sim.decode import create_decode_app
from sidecar.sim.decode.config import DecodeSimConfig
from sidecar.sim.decode.nixl import VllmDHooks
from sidecar.sim.prefill import PrefillSimConfig, create_prefill_app
from sidecar.sim.servers import ServerThread, serve
from tests.support.ports import free_port
from tests.support.runner import Sidecar, run_sidecar
from tests.support.sims import VERSION, chat, completion, p_stats, pd, wait_stats

pytestmark = pytest.mark.nixl


def test_admitted_request_runs_both_legs_and_d_frees_p() -> None:
    with pd() as ([p], d, sc):
        response = httpx.post(
            sc.url + "/v1/completions", json=completion(20), headers={"x-request-id": "rt-1"}
        )
        assert response.status_code == 200
        assert response.headers["x-request-id"] == "rt-1"
        after = wait_stats(p, lambda s: s["pinned_requests"] == 0)
        assert after["freed_by_notification"] == 1 and after["notifs_per_rank"] == [1, 1]
        log = httpx.get(d.url + "/sim/log").json()
        assert log[0]["request_id"] == "rt-1" and log[0]["admitted"]
        params = log[0]["kv_transfer_params"]
        assert params["do_remote_prefill"] is True and params["remote_engine_id"] == after["engine_id"]
        sc.settle()
        assert sc.sample("kvr_releases_total", strategy="nixl", result="sent") == 0


def test_streaming_chat_passes_through_and_is_freed_by_d() -> None:
    with pd() as ([p], _d, sc):
        with httpx.stream(
            "POST", sc.url + "/v1/chat/completions", json=chat("hello there", stream=True)
        ) as r:
            assert r.status_code == 200
            text = b"".join(r.iter_raw()).decode()
        assert text.rstrip().endswith("data: [DONE]")
        wait_stats(p, lambda s: s["pinned_requests"] == 0 and s["freed_by_notification"] == 1)


def test_d_rejection_is_released_by_the_router() -> None:
    with pd() as ([p], _d, sc):
        # prompt over D's max_model_len: P prefilled it (its limit is larger), D refuses it
        response = httpx.post(sc.url + "/v1/completions", json=completion(60, max_tokens="x"))
        assert response.status_code == 400
        after = wait_stats(p, lambda s: s["pinned_requests"] == 0)
        assert after["notifs_per_rank"] == [1, 1] and after["notifs_unknown"] == 0
        sc.settle()
        assert sc.sample("kvr_releases_total", strategy="nixl", result="sent") == 1
        assert sc.sample("kvr_leg_failures_total", leg="decode", cause="status_4xx") == 1


def test_d_unreachable_releases_and_answers_503() -> None:
    p_app = create_prefill_app(
        PrefillSimConfig(port=0, vllm_version=VERSION, tp=1, lease=0, side_channel_port=0)
    )
    with (
        serve(p_app) as p,
        run_sidecar(
            f"http://127.0.0.1:{free_port()}",
            release="nixl",
            prefill_allow=("127.0.0.1",),
            prefill=(p.url,),
            vllm_version=VERSION,
        ) as sc,
    ):
        response = httpx.post(sc.url + "/v1/completions", json=completion(20))
        assert response.status_code == 503
        wait_stats(p, lambda s: s["pinned_requests"] == 0 and s["freed_by_notification"] == 1)
        assert sc.sample("kvr_leg_failures_total", leg="decode", cause="connect_refused") == 1


def test_decode_leg_header_timeout_releases() -> None:
    with pd(header_timeout=0.3) as ([p], _d, sc):
        body = {"model": "m", "prompt": "tok tok [[slow-headers:3]]", "max_tokens": 2}
        response = httpx.post(sc.url + "/v1/completions", json=body)
        assert response.status_code == 504
        after = wait_stats(p, lambda s: s["pinned_requests"] == 0)
        assert after["freed_by_notification"] == 1


def test_client_supplied_params_are_dropped() -> None:
    with pd() as ([p], d, sc):
        evil = {
            "do_remote_prefill": True,
            "remote_engine_id": "x",
            "remote_host": "10.9.9.9",
            "remote_port": 1,
            "remote_block_ids": [1],
            "remote_request_id": "victim",
        }
        response = httpx.post(sc.url + "/v1/completions", json=completion(5, kv_transfer_params=evil))
        assert response.status_code == 200
        params = httpx.get(d.url + "/sim/log").json()[0]["kv_transfer_params"]
        assert params["remote_host"] != "10.9.9.9" and params["remote_request_id"] != "victim"
        assert sc.sample("kvr_ineligible_total", reason="client_params_dropped") == 1
        wait_stats(p, lambda s: s["pinned_requests"] == 0)


def test_n_greater_than_one_is_refused_or_sent_decode_only() -> None:
    with pd() as ([p], _d, sc):
        response = httpx.post(sc.url + "/v1/completions", json=completion(5, n=2))
        assert response.status_code == 400 and response.json()["error"]["param"] == "n"
        assert p_stats(p)["pinned_requests"] == 0 and p_stats(p)["freed_by_notification"] == 0
    with pd(decode_only_fallback=True) as ([p], d, sc):
        response = httpx.post(sc.url + "/v1/completions", json=completion(5, n=2))
        assert response.status_code == 200
        assert httpx.get(d.url + "/sim/log").json()[0]["kv_transfer_params"] is None
        assert p_stats(p)["handshakes_served"] == 0


def test_failing_prefill_is_retried_on_another_and_skipped_for_a_backoff() -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    with pd(prefill_policy="round-robin") as ([p], _d, sc):
        assert sc.app.runtime is not None
        router = sc.app.runtime.proxy.router.pool if sc.app.runtime.proxy.router else None
        assert router is not None
        router.static = [dead, p.url]
        for _ in range(4):
            assert httpx.post(sc.url + "/v1/completions", json=completion(5)).status_code == 200
        assert (
            sc.sample("kvr_leg_failures_total", leg="prefill", cause="connect_refused") == 1
        )  # then backed off
        wait_stats(p, lambda s: s["freed_by_notification"] == 4)


def test_no_prefill_left_is_503_or_decode_only() -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    with pd(static=False, prefill=(dead,)) as (_ps, d, sc):
        assert httpx.post(sc.url + "/v1/completions", json=completion(5)).status_code == 503
        assert httpx.get(d.url + "/sim/log").json() == []
    with pd(static=False, prefill=(dead,), decode_only_fallback=True) as (_ps, d, sc):
        assert httpx.post(sc.url + "/v1/completions", json=completion(5)).status_code == 200
        assert httpx.get(d.url + "/sim/log").json()[0]["kv_transfer_params"] is None


def test_prefiller_header_selects_p_and_is_checked_against_the_allowlist() -> None:
    with pd(static=False) as ([p], d, sc):
        host_port = p.url.removeprefix("http://")
        response = httpx.post(
            sc.url + "/v1/completions", json=completion(5), headers={"x-prefiller-host-port": host_port}
        )
        assert response.status_code == 200
        wait_stats(p, lambda s: s["freed_by_notification"] == 1)
        denied = httpx.post(
            sc.url + "/v1/completions", json=completion(5), headers={"x-prefiller-host-port": "10.1.2.3:8100"}
        )
        assert denied.status_code == 403 and "allowlist" in denied.json()["error"]["message"]
        bad = httpx.post(
            sc.url + "/v1/completions", json=completion(5), headers={"x-prefiller-host-port": "nope"}
        )
        assert bad.status_code == 400
        # without the header and without a static pool, the request goes straight to D
        assert httpx.post(sc.url + "/v1/completions", json=completion(5)).status_code == 200
        assert httpx.get(d.url + "/sim/log").json()[-1]["kv_transfer_params"] is None


def test_cached_tokens_reported_from_p_not_d() -> None:
    with pd(d_config={"prompt_tokens_details": True}) as ([p], _d, sc):
        body = completion(20)
        direct = httpx.post(
            p.url.replace("http://", "http://") + "/v1/completions", json={**body, "max_tokens": 1}
        )
        assert direct.status_code == 200
        response = httpx.post(sc.url + "/v1/completions", json=body)
        usage = response.json()["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] == 0
        assert int(response.headers["content-length"]) == len(response.content)


def test_client_gone_around_the_prefill_answer_releases() -> None:
    with pd(d_config={"latency": 0}) as ([p], _d, sc):

        async def leave_early() -> None:
            async with httpx.AsyncClient() as client:
                task = asyncio.create_task(
                    client.post(sc.url + "/v1/completions", json=completion(20, max_tokens=4))
                )
                deadline = time.monotonic() + 5
                while p_stats(p)["pinned_requests"] == 0 and not task.done() and time.monotonic() < deadline:  # noqa: ASYNC110 - polls another server
                    await asyncio.sleep(0.001)
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

        asyncio.run(leave_early())
        after = wait_stats(p, lambda s: s["pinned_requests"] == 0)
        assert after["freed_by_notification"] == 1


def test_p_answering_after_the_client_left_is_released() -> None:
    """The client leaves while P still computes (blocks pinned, no answer yet).

    Expected: the sidecar still waits for P's answer, then releases its blocks
    (cause ``client_gone_before_forward``) by notification; D never sees the
    request; the request counts as ``client_gone``.
    """
    with pd(p_config={"latency": 1.0}) as ([p], d, sc):

        async def leave_while_p_computes() -> None:
            async with httpx.AsyncClient() as client:
                task = asyncio.create_task(
                    client.post(sc.url + "/v1/completions", json=completion(20, max_tokens=4))
                )
                deadline = time.monotonic() + 5
                while p_stats(p)["pinned_requests"] == 0 and time.monotonic() < deadline:  # noqa: ASYNC110 - polls another server
                    await asyncio.sleep(0.001)
                assert not task.done(), "P answered before its latency"
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

        left_at = time.monotonic()
        asyncio.run(leave_while_p_computes())
        after = wait_stats(p, lambda s: s["pinned_requests"] == 0)
        assert after["freed_by_notification"] == 1
        assert time.monotonic() - left_at >= 0.5  # freed once P answered, not when the client left
        assert httpx.get(d.url + "/sim/log").json() == []
        assert sc.sample("kvr_rejections_total", cause="client_gone_before_forward") == 1
        assert sc.sample("kvr_requests_total", route="completions", status_class="client_gone") == 1


def test_client_leaving_after_p_answered_is_left_to_d() -> None:
    """The client leaves after P answered, while D (vLLM 0.33, with its own fix) is in its handler.

    Expected: the sidecar closes the decode leg; D's cleanup of the cancelled
    handler notifies P, so the sidecar sends nothing (``covered_by_engine``)
    and P frees the blocks exactly once per rank.
    """
    with pd(d_config={"latency": 0}) as ([p], d, sc):
        body = completion(20, max_tokens=4)
        body["prompt"] += " [[slow-headers:5]]"

        async def leave_while_d_works() -> None:
            async with httpx.AsyncClient() as client:
                task = asyncio.create_task(client.post(sc.url + "/v1/completions", json=body))
                deadline = time.monotonic() + 5
                while not (await client.get(d.url + "/sim/log")).json() and time.monotonic() < deadline:  # noqa: ASYNC110 - polls another server
                    await asyncio.sleep(0.005)
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

        asyncio.run(leave_while_d_works())
        after = wait_stats(p, lambda s: s["pinned_requests"] == 0)
        assert after["freed_by_notification"] == 1 and after["notifs_unknown"] == 0
        assert sc.wait_idle()
        sc.settle()  # the job finished (it may ask D's /version first)
        assert sc.sample("kvr_nixl_notifications_total", result="ok") == 0
        assert sc.sample("kvr_releases_total", strategy="nixl", result="covered_by_engine") == 1


async def test_an_idle_pool_takes_turns() -> None:
    from sidecar.config import Config
    from sidecar.router import PrefillPool

    pool = PrefillPool(Config(prefill=("http://a:1", "http://b:1", "http://c:1")))
    firsts = [(await pool.candidates(None))[0] for _ in range(6)]
    assert firsts == ["http://a:1", "http://b:1", "http://c:1"] * 2
    with pool.leg("http://b:1"):  # busy P goes last
        assert pool.outstanding.get("http://b:1", 0) == 1
        for _ in range(3):
            assert (await pool.candidates(None))[-1] == "http://b:1"
    assert pool.outstanding.get("http://b:1", 0) == 0


def test_decode_json_broken_off_is_a_502_in_vllm_shape() -> None:
    # D admitted the request (200) and broke its JSON answer off: nothing to release (D has it),
    # and the client gets vLLM's error shape rather than a cut body.
    with pd() as ([p], _d, sc):
        response = httpx.post(sc.url + "/v1/chat/completions", json=chat("hello [[drop-mid-stream]]"))
        assert response.status_code == 502
        error = response.json()["error"]
        assert error["type"] == "BadGatewayError" and error["code"] == 502
        assert "broke off" in error["message"]
        sc.settle()
        assert sc.sample("kvr_not_released_total", outcome="no_release", cause="admitted") == 1
        assert sc.sample("kvr_releases_total", strategy="nixl", result="sent") == 0
        assert p_stats(p)["notifs_unknown"] == 0


def test_lax_stream_flag_is_streamed_not_buffered() -> None:
    # vLLM streams for "stream": "yes": the answer must pass through as events (chunked), with
    # cached_tokens corrected in them, not be held whole and rewritten as JSON.
    with pd(d_config={"prompt_tokens_details": True}) as ([p], _d, sc):
        body = chat("hello there", stream="yes", stream_options={"include_usage": True})
        with httpx.stream("POST", sc.url + "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            assert "content-length" not in r.headers
            text = b"".join(r.iter_raw()).decode()
        assert text.rstrip().endswith("data: [DONE]")
        data = [line[5:] for line in text.splitlines() if line.startswith("data:")]
        usage = [json.loads(line) for line in data if '"usage"' in line]
        # D reports the whole prompt as cached (it came from P); P computed it all: 0
        assert usage and usage[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        wait_stats(p, lambda s: s["pinned_requests"] == 0 and s["freed_by_notification"] == 1)


@contextmanager
def router_over_decode_sidecar(
    **router: Any,
) -> Iterator[tuple[ServerThread, ServerThread, Sidecar, Sidecar]]:
    """P, D, a decode sidecar in front of D (trust hmac) and the router in front of that."""
    key = "k" * 32
    p_app = create_prefill_app(
        PrefillSimConfig(port=0, side_channel_port=0, vllm_version=VERSION, tp=2, num_blocks=64, lease=0)
    )
    d_config = DecodeSimConfig(port=0, version=VERSION, max_model_len=40, model="m")
    common: dict[str, Any] = {"release": "nixl", "prefill_allow": ("127.0.0.1",), "trust_key": key}
    with (
        serve(p_app) as p,
        serve(create_decode_app(d_config, VllmDHooks(VERSION))) as d,
        run_sidecar(d.url, trust="hmac", **common) as decode_sidecar,
        run_sidecar(decode_sidecar.url, prefill=(p.url,), **common, **router) as router_sc,
    ):
        yield p, d, decode_sidecar, router_sc


def test_behind_a_router_the_decode_sidecar_releases_once() -> None:
    # The router signs its decode leg; the decode sidecar (trust hmac) verifies and releases D's
    # rejection; the router, told the decode URL releases (decode_releases), does not release
    # it again: P is notified once per rank.
    with router_over_decode_sidecar(decode_releases=True) as (p, _d, decode_sc, router_sc):
        # refused before D's handler (a body D cannot validate): no fix inside D releases it
        response = httpx.post(router_sc.url + "/v1/completions", json=completion(60, max_tokens="x"))
        assert response.status_code == 400, response.text
        after = wait_stats(p, lambda s: s["pinned_requests"] == 0)
        router_sc.settle()
        decode_sc.settle()
        assert after["notifs_per_rank"] == [1, 1] and after["notifs_unknown"] == 0
        assert decode_sc.sample("kvr_releases_total", strategy="nixl", result="sent") == 1
        assert decode_sc.sample("kvr_ineligible_total", reason="untrusted") == 0  # the signature held
        assert router_sc.sample("kvr_releases_total", strategy="nixl", result="sent") == 0
        assert router_sc.sample("kvr_not_released_total", outcome="no_release", cause="delegated") == 1
        # an admitted request is D's to free, as always
        assert httpx.post(router_sc.url + "/v1/completions", json=completion(5)).status_code == 200
        final = wait_stats(p, lambda s: s["pinned_requests"] == 0 and s["freed_by_notification"] == 2)
        assert final["notifs_per_rank"] == [2, 2] and final["notifs_unknown"] == 0


def test_without_decode_releases_both_hops_release() -> None:
    # The control: the same chain without the setting notifies P twice (the second for an id it
    # no longer holds), which is why decode_releases exists.
    with router_over_decode_sidecar() as (p, _d, decode_sc, router_sc):
        rejected = completion(60, max_tokens="x")
        assert httpx.post(router_sc.url + "/v1/completions", json=rejected).status_code == 400
        router_sc.settle()
        decode_sc.settle()
        assert router_sc.sample("kvr_releases_total", strategy="nixl", result="sent") == 1
        assert decode_sc.sample("kvr_releases_total", strategy="nixl", result="sent") == 1
        wait_stats(p, lambda s: sum(s["notifs_per_rank"]) + s["notifs_unknown"] >= 4)
