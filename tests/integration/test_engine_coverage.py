"""D's own fix counts only while D can send it: per vLLM range, who frees P's blocks.

A real P (the prefill simulator, NIXL, TP 2, pins that never expire), a "vLLM
D" simulator (it notifies P itself for its handler's rejections from 0.21.0,
as vLLM's ``_with_kv_transfer_rejection_cleanup`` does, and not at all when its
engine is dead, shutting down or without a KV connector) and a sidecar with
the ``nixl`` strategy that reads D's state (``sidecar.decode.state``). Each
case rejects one request and reads P's record: freed by a notification, each
rank notified exactly once (by D or by the sidecar, never both), and the
sidecar's decision.
"""

from __future__ import annotations

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
from tests.support.runner import Sidecar, run_sidecar
from tests.support.sims import prefill, wait_stats
from tests.support.until import until

pytestmark = pytest.mark.nixl

#: One release of each range whose behaviour differs: 0.21-0.28 (the fix, D's shutdown says
#: Connection: close before 0.28), 0.29-0.32 (admission in the handler), 0.33 (paused engine).
VERSIONS = ["0.21.0", "0.29.0", "0.33.0"]
MODEL = "sim-prefill"


@contextmanager
def cluster(version: str, kv_connector: bool = True) -> Iterator[tuple[ServerThread, ServerThread, Sidecar]]:
    p_config = PrefillSimConfig(
        port=0, vllm_version=version, tp=2, num_blocks=256, lease=0, side_channel_port=0, model=MODEL
    )
    d_config = DecodeSimConfig(
        port=0, version=version, max_model_len=40, model=MODEL, vllm_d=True, kv_connector=kv_connector
    )
    settings: dict[str, Any] = {
        "release": "nixl",
        "prefill_allow": ("127.0.0.1",),
        "decode_health_interval": 0.05,
    }
    with (
        serve(create_prefill_app(p_config)) as p,
        serve(create_decode_app(d_config, VllmDHooks(version))) as d,
        run_sidecar(d.url, **settings) as sc,
    ):
        yield p, d, sc


def switch(d: ServerThread, **change: Any) -> None:
    assert httpx.post(d.url + "/sim/engine", json=change, timeout=5).status_code == 200


def seen(sc: Sidecar, can_notify: bool) -> None:
    """Wait until the sidecar's view of D says so (``kvr_decode_can_notify``)."""
    wanted = f"kvr_decode_can_notify {1.0 if can_notify else 0.0}"
    until(lambda: wanted in httpx.get(sc.admin_url + "/metrics").text, f"D seen with can_notify={can_notify}")


def reject(sc: Sidecar, p: ServerThread, rid: str, kind: str) -> tuple[int, str]:
    """One request D rejects: ``handler`` (unknown model, 404 from D's handler: D's fix covers it),
    ``validation`` (400 before the handler: never covered)."""
    params = prefill(p, rid)
    body: dict[str, Any] = {"model": MODEL, "prompt": "tok", "max_tokens": 4, "kv_transfer_params": params}
    if kind == "handler":
        body["model"] = "no-such-model"
    else:
        body["max_tokens"] = "x"
    answer = httpx.post(sc.url + "/v1/completions", json=body, headers={"x-request-id": rid}, timeout=10)
    return answer.status_code, str(params["remote_request_id"])


def freed_once(p: ServerThread, p_request_id: str) -> None:
    wait_stats(p, lambda s: s["freed_by_notification"] >= 1)
    record = httpx.get(f"{p.url}/sim/requests/{p_request_id}").json()
    assert record["freed_by"] == "notification", record
    assert record["notification_counts"] == [1, 1], record  # one notification per rank: no duplicate


def result(sc: Sidecar, name: str) -> float:
    return sc.sample("kvr_releases_total", strategy="nixl", result=name)


@pytest.mark.parametrize("version", VERSIONS)
def test_a_live_d_releases_its_handler_rejection_itself(version: str) -> None:
    with cluster(version) as (p, _d, sc):
        seen(sc, can_notify=True)
        status, p_id = reject(sc, p, "live-1", "handler")
        assert status == 404
        freed_once(p, p_id)  # by D's own notification
        sc.settle()
        assert (result(sc, "covered_by_engine"), result(sc, "sent")) == (1, 0)


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("mode", ["dead", "no_kv_connector"])
def test_a_d_that_cannot_notify_leaves_the_release_to_the_sidecar(version: str, mode: str) -> None:
    """A dead engine shows on D's /health; a D started without ``--kv-transfer-config`` (it
    cannot change while D runs) shows in D's /metrics, read when the sidecar first reaches D."""
    with cluster(version, kv_connector=mode != "no_kv_connector") as (p, d, sc):
        if mode == "dead":
            switch(d, engine="dead")
        seen(sc, can_notify=False)
        status, p_id = reject(sc, p, f"{mode}-1", "handler")
        assert status == 404  # vLLM checks the model before the engine: D answers, but cannot notify
        freed_once(p, p_id)  # by the sidecar
        sc.settle()
        assert (result(sc, "covered_by_engine"), result(sc, "sent")) == (0, 1)


@pytest.mark.parametrize("version", VERSIONS)
def test_a_d_shutting_down_leaves_the_release_to_the_sidecar(version: str) -> None:
    """The pod is terminating: both containers got SIGTERM. D's engine drops every new request,
    its own release too; the sidecar, which knows it is draining, releases instead."""
    with cluster(version) as (p, d, sc):
        switch(d, engine="shutting_down")
        assert sc.app.runtime is not None
        sc.server.call(_drain(sc))
        seen(sc, can_notify=False)
        status, p_id = reject(sc, p, "down-1", "handler")
        assert status == 404
        freed_once(p, p_id)
        sc.settle()
        assert result(sc, "sent") == 1


async def _drain(sc: Sidecar) -> None:
    assert sc.app.runtime is not None
    sc.app.runtime.drain()


@pytest.mark.parametrize("version", VERSIONS)
def test_a_rejection_before_ds_handler_is_the_sidecars_whatever_ds_state(version: str) -> None:
    with cluster(version) as (p, _d, sc):
        seen(sc, can_notify=True)
        status, p_id = reject(sc, p, "valid-1", "validation")
        assert status == 400
        freed_once(p, p_id)
        sc.settle()
        assert result(sc, "sent") == 1


@pytest.mark.parametrize("version", VERSIONS)
def test_a_responses_input_error_from_a_live_d_is_ds_own(version: str) -> None:
    """``/v1/responses`` answers an input of exactly ``max_model_len`` tokens inside its handler
    (``_validate_generator_input``), typed ``invalid_request_error``: D's own fix releases it,
    the sidecar sends nothing."""
    with cluster(version) as (p, _d, sc):
        seen(sc, can_notify=True)
        params = prefill(p, "resp-1")
        body = {"model": MODEL, "input": " ".join(["tok"] * 40), "kv_transfer_params": params}
        answer = httpx.post(
            sc.url + "/v1/responses", json=body, headers={"x-request-id": "resp-1"}, timeout=10
        )
        assert answer.status_code == 400 and answer.json()["error"]["type"] == "invalid_request_error"
        freed_once(p, str(params["remote_request_id"]))  # by D's own notification
        sc.settle()
        assert (result(sc, "covered_by_engine"), result(sc, "sent")) == (1, 0)
