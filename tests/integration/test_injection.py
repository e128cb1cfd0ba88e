"""Rejection injection: answered by the sidecar, never forwarded, released, labelled injected."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from sidecar.config import ConfigError, load
from sidecar.sim.servers import ServerThread
from tests.support.runner import run_sidecar


def params(rid: str) -> dict[str, Any]:
    return {
        "do_remote_prefill": True,
        "remote_engine_id": "p",
        "remote_request_id": rid,
        "remote_host": "10.0.0.7",
        "remote_port": 5600,
        "remote_block_ids": [[1]],
        "tp_size": 1,
    }


def body(rid: str | None) -> dict[str, Any]:
    request: dict[str, Any] = {"model": "sim-model", "prompt": "hello", "max_tokens": 2}
    if rid is not None:
        request["kv_transfer_params"] = params(rid)
    return request


def injected_ids(settings: dict[str, Any], decode: ServerThread, n: int = 60) -> tuple[list[str], list[str]]:
    """Send ``n`` P/D requests; return (ids answered by injection, ids the sidecar released)."""
    with run_sidecar(decode.url, **settings) as sc:
        injected = []
        for i in range(n):
            response = httpx.post(sc.url + "/v1/completions", json=body(f"r{i}"))
            if response.headers.get("x-kvr-injected") == "true":
                assert response.status_code in settings.get("inject_statuses", (503,))
                error = response.json()["error"]
                assert error["code"] == response.status_code and error["message"]
                injected.append(f"r{i}")
            else:
                assert response.status_code == 200
        sc.settle()
        assert sc.sample("kvr_rejections_total", cause="injected") == len(injected)
        return injected, sc.released()


def test_rate_injection_is_deterministic_under_a_seed_and_released(decode: ServerThread) -> None:
    settings = {"inject_rate": 0.3, "inject_seed": 7, "inject_statuses": (503, 429)}
    first, released = injected_ids(settings, decode)
    second, _ = injected_ids(settings, decode)
    assert first == second
    assert 5 < len(first) < 35
    assert sorted(released) == sorted(first)
    third, _ = injected_ids({**settings, "inject_seed": 8}, decode)
    assert third != first


def test_injected_requests_never_reach_d(decode: ServerThread) -> None:
    httpx.post(decode.url + "/sim/reset")
    injected, _ = injected_ids({"inject_rate": 1.0, "inject_seed": 1}, decode, n=5)
    assert len(injected) == 5
    assert httpx.get(decode.url + "/sim/log").json() == []


def test_rate_injection_skips_requests_that_are_not_pd_and_filtered_routes(decode: ServerThread) -> None:
    with run_sidecar(decode.url, inject_rate=1.0, inject_routes=("/v1/chat/completions",)) as sc:
        assert httpx.post(sc.url + "/v1/completions", json=body("a")).status_code == 200
        with_chat = {
            "model": "sim-model",
            "messages": [{"role": "user", "content": "x"}],
            "kv_transfer_params": params("b"),
        }
        assert httpx.post(sc.url + "/v1/chat/completions", json=with_chat).status_code == 503
        plain = {"model": "sim-model", "messages": [{"role": "user", "content": "x"}]}
        assert httpx.post(sc.url + "/v1/chat/completions", json=plain).status_code == 200
        sc.settle()
        assert sc.released() == ["b"]


def test_header_injection_only_when_enabled(decode: ServerThread) -> None:
    headers = {"x-kvr-inject-reject": "429"}
    with run_sidecar(decode.url) as sc:
        assert httpx.post(sc.url + "/v1/completions", json=body("h0"), headers=headers).status_code == 200
    with run_sidecar(decode.url, inject_header=True) as sc:
        response = httpx.post(sc.url + "/v1/completions", json=body("h1"), headers=headers)
        assert response.status_code == 429 and response.headers["x-kvr-injected"] == "true"
        ignored = httpx.post(
            sc.url + "/v1/completions", json=body("h2"), headers={"x-kvr-inject-reject": "200"}
        )
        assert ignored.status_code == 200  # not an error status: forwarded normally
        plain = httpx.post(sc.url + "/v1/completions", json=body(None), headers=headers)
        assert plain.status_code == 429  # injected, but nothing to release
        sc.settle()
        assert sc.released() == ["h1"]
        assert sc.releaser.recorded[0].injected is True
        assert sc.releaser.recorded[0].cause == "injected"
        assert sc.sample("kvr_injected_total", status_class="4xx") == 2


@pytest.mark.parametrize(
    ("env", "field"),
    [
        ({"KVR_INJECT_RATE": "1.5"}, "inject_rate"),
        ({"KVR_INJECT_STATUSES": "200"}, "inject_statuses"),
        ({"KVR_INJECT_ROUTES": "/v1/embeddings"}, "inject_routes"),
    ],
)
def test_injection_settings_are_validated(env: dict[str, str], field: str) -> None:
    with pytest.raises(ConfigError) as info:
        load({}, env)
    assert info.value.field == field
