"""Every route llm-d disaggregates, through the real router and the simulators (real NIXL).

Chat with ``min_tokens`` (the prefill leg caps it with the output budget, or P
refuses it as vLLM does), Anthropic's ``/v1/messages`` and vLLM's token-in
``/inference/v1/generate``: the prefill leg on P, the decode leg on D, D frees
P's blocks when it admits the request, the sidecar when D refuses it. The same
two routes in sidecar mode carry the client's own ``kv_transfer_params``.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.support.sims import chat, cluster, generate, messages, p_stats, pd, prefill, wait_stats

pytestmark = pytest.mark.nixl


def test_min_tokens_is_capped_on_p_and_restored_on_d() -> None:
    with pd() as ([p], d, sc):
        body = chat("one two three", max_tokens=20, min_tokens=10)
        response = httpx.post(sc.url + "/v1/chat/completions", json=body, headers={"x-request-id": "mt-1"})
        assert response.status_code == 200, response.text
        wait_stats(p, lambda s: s["pinned_requests"] == 0 and s["freed_by_notification"] == 1)
        direct = httpx.post(
            p.url + "/v1/chat/completions",
            json={**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}},
        )
        # What P answers a leg that caps max_tokens only (vLLM's SamplingParams check).
        assert direct.status_code == 400
        assert "min_tokens must be less than or equal to max_tokens=1, got 10." in direct.text
        assert httpx.get(d.url + "/sim/log").json()[0]["admitted"]


def test_messages_take_the_prefill_leg_and_d_frees_p() -> None:
    with pd() as ([p], d, sc):
        response = httpx.post(
            sc.url + "/v1/messages", json=messages("hello there"), headers={"x-request-id": "m-1"}
        )
        assert response.status_code == 200, response.text
        answer = response.json()
        assert answer["type"] == "message" and answer["content"][0]["type"] == "text"
        after = wait_stats(p, lambda s: s["pinned_requests"] == 0)
        assert after["freed_by_notification"] == 1 and after["notifs_per_rank"] == [1, 1]
        [entry] = httpx.get(d.url + "/sim/log").json()
        assert entry["route"] == "/v1/messages" and entry["kv_transfer_params"]["do_remote_prefill"] is True
        sc.settle()
        assert sc.sample("kvr_releases_total", strategy="nixl", result="sent") == 0


def test_streamed_messages_are_freed_by_d() -> None:
    with pd() as ([p], _d, sc):
        with httpx.stream("POST", sc.url + "/v1/messages", json=messages("hi", stream=True)) as r:
            assert r.status_code == 200
            text = b"".join(r.iter_raw()).decode()
        assert text.startswith("event: message_start") and "event: message_stop" in text
        wait_stats(p, lambda s: s["pinned_requests"] == 0 and s["freed_by_notification"] == 1)


def test_messages_refused_before_the_handler_are_released_by_the_router() -> None:
    with pd() as ([p], _d, sc):
        response = httpx.post(sc.url + "/v1/messages", json=messages("hi", max_tokens="x"))
        assert response.status_code == 400
        after = wait_stats(p, lambda s: s["pinned_requests"] == 0)
        assert after["notifs_per_rank"] == [1, 1] and after["notifs_unknown"] == 0
        sc.settle()
        assert sc.sample("kvr_releases_total", strategy="nixl", result="sent") == 1


def test_messages_refused_in_the_handler_are_anthropic_shaped_and_freed() -> None:
    # A prompt over D's max_model_len (40) but within P's: D's chat handler refuses it (and, as
    # vLLM's cleanup does, notifies P); the sidecar's own release may follow after the delay.
    with pd(may_cover_delay=0.05) as ([p], _d, sc):
        response = httpx.post(sc.url + "/v1/messages", json=messages(" ".join(["w"] * 60)))
        assert response.status_code == 400
        error = response.json()
        assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
        wait_stats(p, lambda s: s["pinned_requests"] == 0 and s["freed_by_notification"] == 1)


def test_generate_takes_the_prefill_leg_with_sampling_params_capped() -> None:
    with pd() as ([p], d, sc):
        body = generate(12, max_tokens=20, min_tokens=10)
        response = httpx.post(sc.url + "/inference/v1/generate", json=body, headers={"x-request-id": "g-1"})
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["token_ids"]
        after = wait_stats(p, lambda s: s["pinned_requests"] == 0)
        assert after["freed_by_notification"] == 1 and after["notifs_per_rank"] == [1, 1]
        [entry] = httpx.get(d.url + "/sim/log").json()
        assert entry["route"] == "/inference/v1/generate" and entry["admitted"]


def test_generate_refused_in_the_handler_is_released_by_the_router() -> None:
    # vLLM's cleanup does not wrap the generate handler: D never notifies P, the router does.
    with pd() as ([p], _d, sc):
        response = httpx.post(sc.url + "/inference/v1/generate", json=generate(60))
        assert response.status_code == 400
        after = wait_stats(p, lambda s: s["pinned_requests"] == 0)
        assert after["notifs_per_rank"] == [1, 1] and after["notifs_unknown"] == 0
        sc.settle()
        assert sc.sample("kvr_releases_total", strategy="nixl", result="sent") == 1


@pytest.mark.parametrize("route", ["/v1/messages", "/inference/v1/generate"])
def test_sidecar_mode_releases_the_clients_parameters_on_both_routes(route: str) -> None:
    with cluster("0.33.0", 2) as (p, _d, sc):
        params = prefill(p, "sm-1")
        body = (
            messages("hi", max_tokens="x") if route == "/v1/messages" else {**generate(3), "stream": "maybe"}
        )
        response = httpx.post(
            sc.url + route, json={**body, "kv_transfer_params": params}, headers={"x-request-id": "sm-1"}
        )
        assert response.status_code == 400
        after = wait_stats(p, lambda s: s["pinned_requests"] == 0)
        assert after["freed_by_notification"] == 1 and after["notifs_per_rank"] == [1, 1]
        sc.settle()
        assert sc.sample("kvr_releases_total", strategy="nixl", result="sent") == 1
        assert p_stats(p)["notifs_unknown"] == 0


@pytest.mark.parametrize(
    ("route", "body"),
    [
        ("/v1/messages", messages("hello there")),
        ("/inference/v1/generate", generate(12, min_tokens=6)),
        ("/v1/chat/completions", chat("hello there", max_tokens=20, min_tokens=10)),
    ],
)
def test_llmds_prefiller_header_takes_every_route_to_p(route: str, body: dict[str, Any]) -> None:
    with pd(static=False, answers="llm-d") as ([p], d, sc):
        header = {"x-prefiller-host-port": p.url.removeprefix("http://")}
        response = httpx.post(sc.url + route, json=body, headers=header)
        assert response.status_code == 200, response.text
        after = wait_stats(p, lambda s: s["pinned_requests"] == 0)
        assert after["freed_by_notification"] == 1 and after["notifs_per_rank"] == [1, 1]
        [entry] = httpx.get(d.url + "/sim/log").json()
        assert entry["admitted"] and entry["kv_transfer_params"]["do_remote_prefill"] is True
