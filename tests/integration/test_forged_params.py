"""Forged ``kv_transfer_params`` through ``serve`` and ``pd-sidecar`` as shipped: P keeps its side channel.

P is the P simulator (real NIXL agents, vLLM's listener strictness: a request for a rank
it lacks ends the listener thread, ``listener_errors`` says why); D is the decode simulator
wanting an API key, so a client without it is refused (401) before admission. The sidecar is
the real process with its shipped defaults and only what the scenario needs:
``serve --release nixl --prefill-allow 127.0.0.1``, or ``pd-sidecar`` with llm-d's args and
``KVR_PREFILL_ALLOW``. The same scenarios against vLLM's own P code are in
tests/conformance/test_vllm_forged_params.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest

from sidecar.nixl.versions import WireProfile
from sidecar.sim.decode import create_decode_app
from sidecar.sim.decode.config import DecodeSimConfig
from sidecar.sim.prefill import PrefillSimConfig, create_prefill_app
from sidecar.sim.servers import ServerThread, serve
from tests.support.ports import free_port
from tests.support.runner import answers, sidecar, wait_sample
from tests.support.sims import p_stats, prefill, wait_stats

pytestmark = pytest.mark.nixl

API_KEY = "d-api-key"
MODEL = "sim-prefill"


@contextmanager
def p_and_d(version: str, tp: int) -> Iterator[tuple[ServerThread, ServerThread]]:
    p_config = PrefillSimConfig(
        port=0, vllm_version=version, tp=tp, num_blocks=64, lease=0, side_channel_port=0
    )
    d_config = DecodeSimConfig(port=0, version=version, max_model_len=40, model=MODEL, api_key=API_KEY)
    with serve(create_prefill_app(p_config)) as p, serve(create_decode_app(d_config)) as d:
        yield p, d


def ask(url: str, rid: str, params: dict[str, Any], headers: dict[str, str] | None = None) -> int:
    """A completion carrying ``params``, without D's API key."""
    body = {"model": MODEL, "prompt": "tok tok tok", "max_tokens": 2, "kv_transfer_params": params}
    response = httpx.post(
        url + "/v1/completions", json=body, headers={"x-request-id": rid, **(headers or {})}
    )
    return response.status_code


def alive(p: ServerThread) -> None:
    now = p_stats(p)
    assert now["listener_alive"] and now["listener_errors"] == [None], now["listener_errors"]


@pytest.mark.parametrize("version", ["0.21.0", "0.34.0"])
def test_serve_with_shipped_defaults_stops_a_forged_engine_id_at_rank_zero(version: str) -> None:
    """A client without D's key replays a held request's parameters with a ``tp_size`` (or
    ``pp_size``) P lacks and a made-up engine id: D says 401, the release asks rank (0, 0) alone,
    and P's listener answers the true release that follows."""
    with p_and_d(version, 1) as (p, d):
        true = prefill(p, "true")
        forged = {"tp_size": {"tp_size": 2}, "engine_id": {}}
        profile = WireProfile.for_version(version)
        if profile is not None and profile.wire.pp_on_pull:
            forged["pp_size"] = {"pp_size": 2}
        port, admin = free_port(), free_port()
        args = ["--decode-url", d.url, "--release", "nixl", "--prefill-allow", "127.0.0.1"]
        args += ["--host", "127.0.0.1", "--port", str(port), "--admin-host", "127.0.0.1"]
        args += ["--admin-port", str(admin)]
        url, admin_url = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{admin}"
        with sidecar(args, {}, lambda: answers(admin_url + "/readyz")):
            for name, change in forged.items():
                params = {
                    **true,
                    "remote_engine_id": "bogus",
                    "remote_request_id": f"forged-{name}",
                    **change,
                }
                assert ask(url, f"forged-{name}", params) == 401
            wait_sample(admin_url, "kvr_nixl_refused_total", len(forged), reason="engine_mismatch")
            assert p_stats(p)["handshakes_served"] == len(forged)  # rank (0, 0), once each
            alive(p)
            assert ask(url, "true", true) == 401
            after = wait_stats(p, lambda s: s["pinned_requests"] == 0)
            assert after["notifs_per_rank"] == [1] and after["notifs_unknown"] == 0
        alive(p)


def test_pd_sidecar_never_releases_a_clients_own_parameters_and_releases_its_own_legs() -> None:
    """``pd-sidecar`` with an allowlist: a request without llm-d's header carrying P's true engine
    id and a ``tp_size`` P lacks goes to D (401) and is never released; a request with the header
    runs the prefill leg on P, and its rejected decode leg is released on every rank."""
    with p_and_d("0.34.0", 2) as (p, d):
        held = prefill(p, "held")
        port, admin = free_port(), free_port()
        args = [f"--port={port}", f"--model-server-port={d.port}", "--secure-proxy=false"]
        args.append("--kv-connector=nixlv2")
        env = {"KVR_ADMIN_PORT": str(admin), "KVR_PREFILL_ALLOW": "127.0.0.1"}
        url, admin_url = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{admin}"
        with sidecar(args, env, lambda: answers(admin_url + "/readyz")):
            assert ask(url, "forged", {**held, "tp_size": 4, "remote_request_id": "forged"}) == 401
            assert ask(url, "own", held) == 401  # P's true parameters, sent by the client itself
            wait_sample(admin_url, "kvr_ineligible_total", 2, reason="client_params_dropped")
            assert p_stats(p)["handshakes_served"] == 0
            alive(p)
            header = {"x-prefiller-host-port": f"127.0.0.1:{p.port}"}
            assert ask(url, "routed", {}, header) == 401  # the decode leg, P's own parameters
            after = wait_stats(p, lambda s: s["pinned_requests"] == 1)  # the client's own stays held
            assert after["notifs_per_rank"] == [1, 1] and after["notifs_unknown"] == 0
            wait_sample(admin_url, "kvr_releases_total", 1, strategy="nixl", result="sent")
        alive(p)
