"""Trust: only parameters the sidecar can trust trigger releases; replays of live ones never do."""

from __future__ import annotations

from typing import Any

import httpx
import msgspec
import pytest

from sidecar.config import Config, ConfigError
from sidecar.decision.judge import InFlight
from sidecar.proxy.trust import Trust, sign
from sidecar.sim.decode.config import DecodeSimConfig
from sidecar.sim.servers import ServerThread, serve
from tests.support.runner import run_sidecar

DECODE = DecodeSimConfig(port=0, log_params=True)  # D for this module (the ``decode`` fixture)

KEY = "shared-router-key"


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


def rejected(rid: str) -> bytes:
    """A body D rejects (validation, before its handler), carrying ``params(rid)`` as its last member."""
    return msgspec.json.encode(
        {"model": "sim-model", "prompt": "x", "max_tokens": "x", "kv_transfer_params": params(rid)}
    )


def test_hmac_mode_releases_only_signed_parameters(decode: ServerThread) -> None:
    with run_sidecar(decode.url, trust="hmac", trust_key=KEY) as sc:
        raw = msgspec.json.encode(params("signed"))
        good = {"x-request-id": "r1", "x-kvr-params-signature": sign(KEY.encode(), "r1", raw)}
        assert (
            httpx.post(sc.url + "/v1/completions", content=rejected("signed"), headers=good).status_code
            == 400
        )
        unsigned = {"x-request-id": "r2"}
        assert (
            httpx.post(sc.url + "/v1/completions", content=rejected("unsigned"), headers=unsigned).status_code
            == 400
        )
        # a valid signature of other parameters, or for another request id, does not transfer
        moved = {"x-request-id": "r3", "x-kvr-params-signature": good["x-kvr-params-signature"]}
        assert (
            httpx.post(sc.url + "/v1/completions", content=rejected("signed2"), headers=moved).status_code
            == 400
        )
        forged = {"x-request-id": "r4", "x-kvr-params-signature": "00" * 32}
        assert (
            httpx.post(sc.url + "/v1/completions", content=rejected("forged"), headers=forged).status_code
            == 400
        )
        sc.settle()
        assert sc.released() == ["signed"]
        assert sc.sample("kvr_ineligible_total", reason="untrusted") == 3


def test_token_mode(decode: ServerThread) -> None:
    with run_sidecar(decode.url, trust="token", trust_token="t0ken") as sc:
        for rid, token in [("a", "t0ken"), ("b", "wrong"), ("c", None)]:
            headers = {"x-kvr-router-token": token} if token else {}
            assert (
                httpx.post(sc.url + "/v1/completions", content=rejected(rid), headers=headers).status_code
                == 400
            )
        sc.settle()
        assert sc.released() == ["a"]


def oversized(rid: str) -> bytes:
    """A body over a 4 KiB cap whose last member is ``params(rid)`` (found by the tail scan)."""
    return msgspec.json.encode(
        {"model": "sim-model", "prompt": "x " * 4000, "kv_transfer_params": params(rid)}
    )


def test_an_oversized_body_is_released_only_for_trusted_parameters(decode: ServerThread) -> None:
    """The 413 path finds the parameters at the body's end without decoding it: trust applies
    there too (HMAC over the bytes as sent, or the router token)."""
    with run_sidecar(decode.url, trust="hmac", trust_key=KEY, max_body_bytes=4096) as sc:
        raw = msgspec.json.encode(params("big-signed"))
        signed = {"x-request-id": "b1", "x-kvr-params-signature": sign(KEY.encode(), "b1", raw)}
        for rid, headers in [("big-signed", signed), ("big-unsigned", {"x-request-id": "b2"})]:
            response = httpx.post(sc.url + "/v1/completions", content=oversized(rid), headers=headers)
            assert response.status_code == 413
        sc.settle()
        assert sc.released() == ["big-signed"]
        assert sc.sample("kvr_ineligible_total", reason="untrusted") == 1
    with run_sidecar(decode.url, trust="token", trust_token="t0ken", max_body_bytes=4096) as sc:
        for rid, token in [("t-good", "t0ken"), ("t-none", None)]:
            headers = {"x-kvr-router-token": token} if token else {}
            response = httpx.post(sc.url + "/v1/completions", content=oversized(rid), headers=headers)
            assert response.status_code == 413
        sc.settle()
        assert sc.released() == ["t-good"]


def test_an_oversized_body_in_router_mode_releases_nothing(decode: ServerThread) -> None:
    """Router mode drops client parameters (they could name any P): also in a 413."""
    with run_sidecar(
        decode.url, prefill=("http://127.0.0.1:9",), prefill_allow=("127.0.0.1",), max_body_bytes=4096
    ) as sc:
        response = httpx.post(sc.url + "/v1/completions", content=oversized("router-big"))
        assert response.status_code == 413
        sc.settle()
        assert sc.released() == []


def test_untrusted_parameters_are_still_forwarded(decode: ServerThread) -> None:
    with run_sidecar(decode.url, trust="hmac", trust_key=KEY) as sc:
        body = {"model": "sim-model", "prompt": "hello", "kv_transfer_params": params("fwd")}
        response = httpx.post(sc.url + "/v1/completions", json=body, headers={"x-request-id": "fwd-1"})
        assert response.status_code == 200
        log = {e["request_id"]: e for e in httpx.get(decode.url + "/sim/log").json()}
        assert log["fwd-1"]["kv_transfer_params"]["remote_request_id"] == "fwd"


def test_router_signs_what_it_forwards_and_the_sidecar_in_front_of_d_trusts_it(decode: ServerThread) -> None:
    # router (releases off, signs) -> sidecar (trust hmac, releases) -> D; P is a fake answering params
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    async def prefill(request: Request) -> JSONResponse:
        await request.body()
        return JSONResponse({"id": "cmpl-p", "choices": [], "kv_transfer_params": params("via-router")})

    fake_p = Starlette(routes=[Route("/v1/completions", prefill, methods=["POST"])])
    with (
        serve(fake_p) as p,
        run_sidecar(decode.url, trust="hmac", trust_key=KEY) as downstream,
        run_sidecar(downstream.url, release="off", prefill=(p.url,), trust_key=KEY) as router,
    ):
        body = {"model": "sim-model", "prompt": "x", "max_tokens": "x"}  # D rejects it
        assert httpx.post(router.url + "/v1/completions", json=body).status_code == 400
        downstream.settle()
        assert downstream.released() == ["via-router"]


def test_trust_settings_are_checked() -> None:
    with pytest.raises(ConfigError, match="trust_key"):
        Trust(Config(trust="hmac"))
    with pytest.raises(ConfigError, match="trust_token"):
        Trust(Config(trust="token"))
    with pytest.raises(ConfigError, match="trust_key_file"):
        Trust(Config(trust="hmac", trust_key_file="/nonexistent/key"))


def test_inflight_tracks_live_and_admitted_keys() -> None:
    now = [0.0]
    inflight = InFlight(size=2, ttl=30, clock=lambda: now[0])
    inflight.forwarded("a")
    inflight.forwarded("a")
    assert inflight.may_be_read("a")
    inflight.finished("a", admitted=False)
    assert inflight.may_be_read("a")  # the other copy is still at D
    inflight.finished("a", admitted=False)
    assert not inflight.may_be_read("a")
    inflight.forwarded("b")
    inflight.finished("b", admitted=True)
    assert inflight.may_be_read("b")
    now[0] = 31
    assert not inflight.may_be_read("b")  # P's lease is over


def test_parameters_of_an_aborted_request_are_not_released_again(decode: ServerThread) -> None:
    """A header timeout (released with ``--release-ambiguous``) leaves D holding the request until
    its handler cleans up: a later rejected request naming the same parameters is not released."""
    with run_sidecar(decode.url, release_ambiguous=True, header_timeout=0.3) as sc:
        slow = {"model": "sim-model", "prompt": "x [[slow-headers:2]]", "kv_transfer_params": params("again")}
        assert (
            httpx.post(sc.url + "/v1/completions", json=slow, headers={"x-request-id": "a1"}).status_code
            == 504
        )
        sc.settle()
        assert sc.released() == ["again"]
        replay = httpx.post(
            sc.url + "/v1/completions", content=rejected("again"), headers={"x-request-id": "a2"}
        )
        assert replay.status_code == 400
        sc.settle()
        assert sc.released() == ["again"]  # only the first
        assert sc.sample("kvr_not_released_total", outcome="no_release", cause="params_in_use") == 1
