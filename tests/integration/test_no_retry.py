"""Answers whose kv_transfer_params were released say ``x-should-retry: false``.

A client that retries such a request with the same parameters would get 409
(P may already reuse the blocks), hiding the original error. The OpenAI SDKs
retry 408, 409, 429 and 5xx twice by default unless the answer carries
``x-should-retry: false``: with it, the caller sees the real status. Real P
simulator (NIXL, TP 2), real sidecar, the official ``openai`` client.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import openai
import pytest

from sidecar.sim.decode import create_decode_app
from sidecar.sim.decode.config import DecodeSimConfig
from sidecar.sim.prefill import PrefillSimConfig, create_prefill_app
from sidecar.sim.servers import ServerThread, serve
from tests.support.ports import free_port
from tests.support.runner import RETRIED, SHIPPED, Sidecar, run_sidecar
from tests.support.sims import prefill, wait_stats

pytestmark = pytest.mark.nixl

VERSION = "0.33.0"


@contextmanager
def p_only(tp: int = 2) -> Iterator[ServerThread]:
    config = PrefillSimConfig(
        port=0, vllm_version=VERSION, tp=tp, num_blocks=256, lease=0, side_channel_port=0
    )
    with serve(create_prefill_app(config)) as p:
        yield p


def nixl(decode_url: str, **settings: Any) -> Any:
    base = {"release": "nixl", "prefill_allow": ("127.0.0.1",), "vllm_version": VERSION}
    return run_sidecar(decode_url, **{**base, **settings})


def freed(p: ServerThread, p_request_id: str) -> dict[str, Any]:
    found: dict[str, Any] = httpx.get(f"{p.url}/sim/requests/{p_request_id}").json()
    return found


def requests_seen(sc: Sidecar, status_class: str) -> float:
    return sc.sample("kvr_requests_total", route="completions", status_class=status_class)


@RETRIED
def test_the_sdk_with_default_retries_sees_ds_503_and_p_is_freed_once(retried: object) -> None:
    """D down: under ``retried_statuses = none`` the sidecar releases and says not to retry; under
    the shipped default a proxy in front may resend the 503 to another pod, so nothing is released
    and the answer leaves the client free to retry (the SDK does, twice)."""
    down = f"http://127.0.0.1:{free_port()}"  # D is down: nothing listens there
    with p_only() as p, nixl(down, retried_statuses=retried) as sc:
        params = prefill(p, "sdk-1")
        client = openai.OpenAI(base_url=sc.url + "/v1", api_key="unused")  # max_retries=2
        with pytest.raises(openai.InternalServerError) as caught:
            client.completions.create(
                model="sim-prefill",
                prompt="tok tok",
                max_tokens=4,
                extra_body={"kv_transfer_params": params},
                extra_headers={"x-request-id": "sdk-1"},
            )
        client.close()
        assert caught.value.status_code == 503
        assert requests_seen(sc, "4xx") == 0  # so no 409 hid the 503
        if retried == SHIPPED:
            assert "x-should-retry" not in caught.value.response.headers
            assert requests_seen(sc, "5xx") == 3  # the SDK's request and its two retries
            sc.settle()
            assert sc.sample("kvr_not_released_total", outcome="retryable", cause="unreachable") == 3
            assert sc.sample("kvr_releases_total", strategy="nixl", result="sent") == 0
            assert freed(p, params["remote_request_id"])["freed_by"] is None  # P still holds them
            return
        assert caught.value.response.headers["x-should-retry"] == "false"
        assert requests_seen(sc, "5xx") == 1  # no retry reached the sidecar
        wait_stats(p, lambda s: s["freed_by_notification"] == 1)
        record = freed(p, params["remote_request_id"])
        assert record["freed_by"] == "notification"
        assert record["notification_counts"] == [1, 1]  # each rank notified exactly once


def test_released_answers_and_replays_say_do_not_retry_the_rest_do_not() -> None:
    d_config = DecodeSimConfig(port=0, version=VERSION, max_model_len=40, model="sim-prefill")
    with p_only() as p, serve(create_decode_app(d_config)) as d, nixl(d.url) as sc:
        body: dict[str, Any] = {"model": "sim-prefill", "prompt": "tok", "max_tokens": "x"}
        spent = {**body, "kv_transfer_params": prefill(p, "r-1")}
        rejected = httpx.post(sc.url + "/v1/completions", json=spent, headers={"x-request-id": "r-1"})
        assert rejected.status_code == 400 and rejected.headers["x-should-retry"] == "false"
        again = httpx.post(sc.url + "/v1/completions", json=spent, headers={"x-request-id": "r-1"})
        assert again.status_code == 409 and again.headers["x-should-retry"] == "false"
        # A rejection without parameters released nothing: the client may retry it.
        plain = httpx.post(sc.url + "/v1/completions", json=body)
        assert plain.status_code == 400 and "x-should-retry" not in plain.headers
        # An admitted request: no header.
        ok = httpx.post(
            sc.url + "/v1/completions",
            json={**body, "max_tokens": 2, "kv_transfer_params": prefill(p, "ok-1")},
            headers={"x-request-id": "ok-1"},
        )
        assert ok.status_code == 200 and "x-should-retry" not in ok.headers


def test_a_strategy_that_frees_nothing_leaves_retries_to_the_client() -> None:
    down = f"http://127.0.0.1:{free_port()}"
    with p_only() as p, run_sidecar(down, release="dry-run") as sc:
        answer = httpx.post(
            sc.url + "/v1/completions",
            json={"model": "sim-prefill", "prompt": "tok", "kv_transfer_params": prefill(p, "dry-1")},
        )
        assert answer.status_code == 503
        assert "x-should-retry" not in answer.headers


def test_router_mode_never_says_it_a_retry_runs_a_fresh_prefill() -> None:
    down = f"http://127.0.0.1:{free_port()}"
    with p_only() as p, nixl(down, prefill=(p.url,)) as sc:
        answer = httpx.post(sc.url + "/v1/completions", json={"model": "sim-prefill", "prompt": "tok tok"})
        assert answer.status_code == 503
        assert "x-should-retry" not in answer.headers
        wait_stats(p, lambda s: s["freed_by_notification"] == 1)  # the router released it
