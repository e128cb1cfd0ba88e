"""Another P/D protocol than nixlv2: the pod serves, releases are off, and a header-named P gets
what the protocol allows (docs/llm-d.md, "Another P/D protocol").

The sidecar runs in process with the config llm-d's command line gives (``pd-sidecar``'s
``load``), in front of sim-decode, with a P that counts what reaches it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest
from prometheus_client import CollectorRegistry
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from sidecar.app import Deps, create_admin_app, create_app
from sidecar.app.ranks import RankFront
from sidecar.llmd.command import load
from sidecar.sim.decode import create_decode_app
from sidecar.sim.decode.config import DecodeSimConfig
from sidecar.sim.servers import ServerThread, serve
from tests.support.sims import completion


class CountingP:
    """A P that answers every prefill leg and counts them."""

    def __init__(self) -> None:
        self.legs = 0

    def app(self) -> Starlette:
        async def leg(request: Request) -> JSONResponse:
            self.legs += 1
            return JSONResponse({"choices": [{"text": ""}], "kv_transfer_params": None})

        return Starlette(routes=[Route("/v1/completions", leg, methods=["POST"])])


@contextmanager
def pd_sidecar(*argv: str) -> Iterator[tuple[str, str, ServerThread, ServerThread, CountingP]]:
    """The sidecar with llm-d's args ``argv``, P on loopback allowed (``KVR_PREFILL_ALLOW``)."""
    counting = CountingP()
    d_config = DecodeSimConfig(port=0, model="m", log_params=True)
    with serve(create_decode_app(d_config)) as d, serve(counting.app()) as p:
        args = ["--port=0", "--secure-proxy=false", f"--vllm-port={d.port}", *argv]
        config, _ = load(args, {"KVR_PREFILL_ALLOW": "127.0.0.1"})
        app = create_app(config, Deps(registry=CollectorRegistry()))
        with serve(RankFront(app, 0, config), create_admin_app(app)) as server:
            yield server.urls[0], server.urls[1], d, p, counting


@pytest.mark.parametrize("connector", ["shared-storage", "mooncake", "offloading"])
def test_a_vllm_connector_this_sidecar_does_not_run_sends_d_the_request_alone(connector: str) -> None:
    with pd_sidecar(f"--kv-connector={connector}") as (url, admin, d, p, counting):
        header = {"x-prefiller-host-port": f"127.0.0.1:{p.port}", "x-request-id": "alone"}
        answer = httpx.post(url + "/v1/completions", json=completion(5), headers=header, timeout=20)
        assert answer.status_code == 200 and answer.json()["choices"]
        assert counting.legs == 0  # no prefill leg
        log = httpx.get(d.url + "/sim/log").json()
        assert [entry["request_id"] for entry in log] == ["alone"] and not log[0]["kv_transfer_params"]
        metrics = httpx.get(admin + "/metrics").text
        assert 'kvr_releases_enabled{reason="kv_connector"} 0.0' in metrics


def test_sglang_s_protocol_is_refused_per_request_and_the_rest_is_served() -> None:
    with pd_sidecar("--kv-connector=sglang") as (url, admin, d, p, counting):
        header = {"x-prefiller-host-port": f"127.0.0.1:{p.port}"}
        refused = httpx.post(url + "/v1/completions", json=completion(5), headers=header, timeout=20)
        assert refused.status_code == 501 and "--kv-connector" in refused.json()["error"]["message"]
        assert counting.legs == 0 and httpx.get(d.url + "/sim/log").json() == []
        plain = httpx.post(url + "/v1/completions", json=completion(5), timeout=20)
        assert plain.status_code == 200  # no P named: D's, as in llm-d
        metrics = httpx.get(admin + "/metrics").text
        assert 'kvr_releases_enabled{reason="kv_connector"} 0.0' in metrics


def test_moriio_and_an_encoder_stage_keep_the_nixlv2_legs_with_releases_off() -> None:
    for argv, reason in ((["--moriio-tp-size=2"], "moriio"), (["--ec-connector=nixl"], "ec_connector")):
        with pd_sidecar(*argv) as (url, admin, _d, p, counting):
            header = {"x-prefiller-host-port": f"127.0.0.1:{p.port}"}
            answer = httpx.post(url + "/v1/completions", json=completion(5), headers=header, timeout=20)
            assert answer.status_code == 200 and counting.legs == 1
            metrics = httpx.get(admin + "/metrics").text
            assert f'kvr_releases_enabled{{reason="{reason}"}} 0.0' in metrics


def test_an_empty_prefiller_header_names_no_p_as_in_llm_d() -> None:
    with pd_sidecar() as (url, _admin, d, _p, counting):
        header = {"x-prefiller-host-port": "", "x-request-id": "empty"}
        answer = httpx.post(url + "/v1/completions", json=completion(5), headers=header, timeout=20)
        assert answer.status_code == 200 and counting.legs == 0
        assert [entry["request_id"] for entry in httpx.get(d.url + "/sim/log").json()] == ["empty"]
