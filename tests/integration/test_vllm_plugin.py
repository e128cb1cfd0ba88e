"""The plugin under real uvicorn, the ``http`` strategy against it, and ``auto`` choosing its path.

D is a FastAPI app mounted the way vLLM mounts the plugin (``attach_router``
while building the app, ``init_state`` once the engine client exists) or a
Starlette app with ``add_middleware`` (the ``--middleware`` form), with a fake
engine client. The ``nixl`` tests use the decode simulator as D and the
prefill simulator as P: the fake engine's release goes out over real NIXL
the way D's connector sends it, so P's ``/stats`` shows the blocks freed.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry

from sidecar.app import Deps, ProxyApp, create_admin_app, create_app
from sidecar.config import Config
from sidecar.release.auto import AutoReleaser
from sidecar.release.base import JobResult, ReleaseJob
from sidecar.release.stub import StubReleaser as DryRunReleaser
from sidecar.sim.decode import create_decode_app
from sidecar.sim.decode.config import DecodeSimConfig
from sidecar.sim.decode.nixl import VllmDHooks
from sidecar.sim.prefill import PrefillSimConfig, create_prefill_app
from sidecar.sim.servers import ServerThread, serve
from sidecar.vllm_plugin import (
    HEALTH_PATH,
    RELEASE_PATH,
    KVReleaseMiddleware,
    KVReleasePlugin,
)
from tests.support.fake_engine import (
    SETTINGS,
    TOKEN,
    LegacyEngine,
    NotifyEngine,
    sampling_params,
    vllm_like,
)
from tests.support.ports import free_port
from tests.support.runner import Sidecar, run_sidecar
from tests.support.sims import wait_stats
from tests.support.until import until

AUTH = {"authorization": f"Bearer {TOKEN}"}
P_PARAMS: dict[str, Any] = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_engine_id": "p-engine",
    "remote_request_id": "cmpl-req-1-0-0a1b2c3d",
    "remote_host": "10.1.2.3",
    "remote_port": 5600,
    "remote_block_ids": [[7, 8, 9]],
    "tp_size": 1,
}


# --- D: vLLM-like apps ------------------------------------------------------------------------


def completion(sc: Sidecar, request_id: str, route: str = "/v1/completions", **params: Any) -> httpx.Response:
    kv = {**P_PARAMS, "remote_request_id": f"{request_id}-p", **params}
    body = {"model": "m", "prompt": "hi", "max_tokens": 4, "kv_transfer_params": kv}
    return httpx.post(sc.url + route, json=body, headers={"x-request-id": request_id}, timeout=10)


# --- the plugin on real servers ---------------------------------------------------------------


def test_endpoint_plugin_mounted_like_vllm_notifies_the_engine() -> None:
    engine = NotifyEngine()
    with serve(vllm_like(engine)) as d:
        body = {"request_id": "rid-1", "kv_transfer_params": P_PARAMS, "data_parallel_rank": 1}
        response = httpx.post(d.url + RELEASE_PATH, json=body, headers=AUTH)
        health = httpx.get(d.url + HEALTH_PATH, headers=AUTH)
        openapi = httpx.get(d.url + "/openapi.json").json()
    assert response.status_code == 202, response.text
    assert response.json()["outcome"] == "notified"
    assert engine.notified == [("rid-1", P_PARAMS, 1)]
    assert health.status_code == 200 and health.json()["action"] == "notify"
    assert RELEASE_PATH not in openapi["paths"]  # a plain route: no schema, no pydantic


def test_middleware_form_emulates_on_an_old_engine() -> None:
    engine = LegacyEngine("hang")
    with serve(vllm_like(engine, plugin=False, middleware=True, version="0.11.0")) as d:
        response = httpx.post(
            d.url + RELEASE_PATH,
            json={"request_id": "cmpl-x-0", "kv_transfer_params": P_PARAMS},
            headers=AUTH,
        )
        passthrough = httpx.get(d.url + "/version")
    assert response.status_code == 202
    assert response.json() == {
        "request_id": "cmpl-x-0",
        "action": "emulate",
        "outcome": "aborted",
        "duplicate": False,
    }
    assert engine.submitted == [("cmpl-x-0", {"prompt_token_ids": [0]}, P_PARAMS, None)]
    assert engine.released == ["cmpl-x-0"] and engine.closed == ["cmpl-x-0"]
    assert passthrough.json() == {"version": "0.11.0"}


def test_auth_bad_bodies_and_idempotency_over_http() -> None:
    engine = NotifyEngine()
    with serve(vllm_like(engine)) as d:
        url = d.url + RELEASE_PATH
        body = {"request_id": "rid-1", "kv_transfer_params": P_PARAMS}
        missing = httpx.post(url, json=body)
        wrong = httpx.post(url, json=body, headers={"authorization": "Bearer nope"})
        bad = httpx.post(url, json={"request_id": "rid-1"}, headers=AUTH)
        first = httpx.post(url, json=body, headers=AUTH)
        again = httpx.post(url, json=body, headers=AUTH)
        counts = httpx.get(d.url + HEALTH_PATH, headers=AUTH).json()["counts"]
    assert (missing.status_code, wrong.status_code, bad.status_code) == (401, 403, 400)
    assert (
        bad.json()["error"]["type"] == "BadRequestError"
        and "kv_transfer_params" in bad.json()["error"]["message"]
    )
    assert first.json()["duplicate"] is False and again.json()["duplicate"] is True
    assert len(engine.notified) == 1
    assert counts == {"unauthorized": 1, "forbidden": 1, "bad_request": 1, "accepted": 1, "duplicate": 1}


# --- the sidecar's http strategy --------------------------------------------------------------


def test_sidecar_http_releases_through_the_plugin() -> None:
    engine = NotifyEngine()
    with serve(vllm_like(engine)) as d, run_sidecar(d.url, release="http", control_token=TOKEN) as sc:
        rejected = completion(sc, "req-1")
        assert rejected.status_code == 400
        until(lambda: engine.notified, "the engine's notify call")
        covered = completion(sc, "req-2", route="/v1/chat/completions")
        assert covered.status_code == 400
        sc.settle()
        expected = {**P_PARAMS, "remote_request_id": "req-1-p"}  # as they came
        assert engine.notified == [("req-1-p", expected, None)]  # req-2 is D's own to release
        assert sc.sample("kvr_releases_total", strategy="http", result="sent") == 1
        assert sc.sample("kvr_releases_total", strategy="http", result="covered_by_engine") == 1
        assert sc.sample("kvr_control_requests_total", result="accepted") == 1


@pytest.mark.parametrize(("token", "reason"), [("not-the-token", "forbidden"), ("", "unauthorized")])
def test_sidecar_http_with_a_bad_token_is_refused(token: str, reason: str) -> None:
    engine = NotifyEngine()
    app = vllm_like(engine)
    with serve(app) as d, run_sidecar(d.url, release="http", control_token=token) as sc:
        assert completion(sc, "req-1").status_code == 400
        sc.settle()
        assert sc.sample("kvr_releases_total", strategy="http", result="refused") == 1
        assert sc.sample("kvr_control_requests_total", result=reason) == 1
        assert app.state.kv_release_control.counts[reason] == 1
    assert engine.notified == []


def test_sidecar_http_without_the_plugin_is_refused_as_not_found() -> None:
    with serve(vllm_like(NotifyEngine(), plugin=False)) as d, run_sidecar(d.url, release="http") as sc:
        assert completion(sc, "req-1").status_code == 400
        sc.settle()
        assert sc.sample("kvr_releases_total", strategy="http", result="refused") == 1
        assert sc.sample("kvr_control_requests_total", result="not_found") == 1


# --- auto -------------------------------------------------------------------------------------


class RecordingNixl:
    """Stands in for ``NixlReleaser`` where the test is about auto's choice, not NIXL."""

    name = "nixl"
    frees = True
    checked = True
    keeps_raw = False

    def __init__(self) -> None:
        self.jobs: list[ReleaseJob] = []

    def detail(self) -> dict[str, object]:
        return {}

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None

    def ready(self) -> bool:
        return True

    def target(self, job: ReleaseJob) -> str:
        return f"{self.name}:{job.params.remote_host}"

    async def release(self, job: ReleaseJob) -> JobResult:
        self.jobs.append(job)
        return JobResult.SENT


@contextmanager
def run_auto(decode_url: str, nixl: Any | None = None, **settings: Any) -> Iterator[Sidecar]:
    """A sidecar with ``--release auto``; ``nixl`` replaces the NIXL strategy when given."""
    settings = {"retried_statuses": ("none",), **settings}  # nothing in front retries D's 503
    config = Config(
        decode_url=decode_url, release="auto", log_level="warning", control_token=TOKEN, **settings
    )
    registry = CollectorRegistry()
    apps: list[ProxyApp] = []

    async def decode_version() -> str | None:
        runtime = apps[0].runtime
        return await runtime.decode.decode_version() if runtime is not None else None

    auto = AutoReleaser(config, decode_version, registry, nixl=nixl)
    app = create_app(config, Deps(releaser=auto, registry=registry))
    apps.append(app)
    with serve(app, create_admin_app(app), server_header=False, date_header=False) as server:
        yield Sidecar(server, app, DryRunReleaser())


def test_auto_uses_the_control_endpoint_then_nixl_when_d_is_down() -> None:
    engine, nixl = NotifyEngine(), RecordingNixl()
    d = ServerThread(vllm_like(engine)).start()
    try:
        with run_auto(d.url, nixl) as sc:
            ready = httpx.get(sc.admin_url + "/readyz").json()
            assert ready["release"]["path"] == "control" and ready["release"]["probe"] == "present"
            assert sc.sample("kvr_release_path", path="control") == 1
            assert completion(sc, "req-1").status_code == 400
            until(lambda: engine.notified, "the engine's notify call")
            d.stop()
            # A pooled connection may still see the old server once (502, ambiguous, not released).
            statuses: list[int] = []
            while 503 not in statuses:
                assert len(statuses) < 3, statuses
                statuses.append(completion(sc, f"down-{len(statuses)}").status_code)
            until(lambda: nixl.jobs, "the NIXL strategy to get the job")
            sc.settle()
            assert [job.cause for job in nixl.jobs] == ["unreachable"]
            assert len(engine.notified) == 1
            assert sc.sample("kvr_auto_releases_total", path="control", result="sent") == 1
            assert sc.sample("kvr_auto_releases_total", path="nixl", result="sent") == 1
            assert sc.sample("kvr_releases_total", strategy="auto", result="sent") == 2
    finally:
        d.stop()


def test_auto_without_the_plugin_uses_nixl() -> None:
    nixl = RecordingNixl()
    with serve(vllm_like(NotifyEngine(), plugin=False)) as d, run_auto(d.url, nixl) as sc:
        ready = httpx.get(sc.admin_url + "/readyz").json()
        assert ready["ready"] is True
        assert ready["release"] == {
            "strategy": "auto",
            "path": "nixl",
            "probe": "absent",
            "control_ready": True,
            "nixl_ready": True,
        }
        assert completion(sc, "req-1").status_code == 400
        sc.settle()
        assert [job.request_id for job in nixl.jobs] == ["req-1"]
        assert sc.sample("kvr_release_path", path="nixl") == 1


def test_auto_switches_to_control_when_the_plugin_appears() -> None:
    nixl, engine = RecordingNixl(), NotifyEngine()
    app = vllm_like(engine, plugin=False)
    with serve(app) as d, run_auto(d.url, nixl, auto_probe_interval=0.05) as sc:
        assert sc.app.runtime is not None
        auto = sc.app.runtime.releaser
        assert isinstance(auto, AutoReleaser) and auto.path == "nixl"
        assert completion(sc, "req-1").status_code == 400
        until(lambda: nixl.jobs, "the NIXL strategy to get the job")
        # In real life D restarts with the plugin; here its route is added to the running app.
        KVReleasePlugin(SETTINGS).attach_router(app)
        until(lambda: auto.path == "control", "a probe to find the endpoint")
        assert completion(sc, "req-2").status_code == 400
        until(lambda: engine.notified, "the engine's notify call")
        sc.settle()
        assert [job.request_id for job in nixl.jobs] == ["req-1"]
        assert [call[0] for call in engine.notified] == ["req-2-p"]


# --- end to end on NIXL: P simulator, D simulator with the plugin ----------------------------


@contextmanager
def pd(version: str, engine_kind: str, tp: int = 2) -> Iterator[tuple[ServerThread, Any, Sidecar]]:
    p_config = PrefillSimConfig(
        port=0, vllm_version=version, tp=tp, num_blocks=256, lease=0, side_channel_port=0
    )
    hooks = VllmDHooks(version)

    async def release(request_id: str, params: dict[str, Any]) -> None:
        await hooks.client.release(params, request_id)  # what D's NIXL connector sends P

    engine = NotifyEngine(release) if engine_kind == "notify" else LegacyEngine("hang", release)
    d_config = DecodeSimConfig(port=0, version=version, max_model_len=40, model="sim-prefill")
    d_app = create_decode_app(d_config, hooks)
    d_app.add_middleware(KVReleaseMiddleware, settings=SETTINGS, sampling_params=sampling_params)
    d_app.state.engine_client = engine
    with (
        serve(create_prefill_app(p_config)) as p,
        serve(d_app) as d,
        run_sidecar(d.url, release="http", control_token=TOKEN) as sc,
    ):
        yield p, engine, sc


def prefill(p: ServerThread, request_id: str) -> dict[str, Any]:
    body = {
        "model": "sim-prefill",
        "prompt": " ".join(["tok"] * 20),
        "max_tokens": 1,
        "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False},
    }
    response = httpx.post(p.url + "/v1/completions", json=body, headers={"x-request-id": request_id})
    assert response.status_code == 200, response.text
    params: dict[str, Any] = response.json()["kv_transfer_params"]
    return params


def decode(sc: Sidecar, request_id: str, params: dict[str, Any], max_tokens: Any = 4, words: int = 5) -> int:
    body = {"model": "sim-prefill", "prompt": " ".join(["tok"] * words), "max_tokens": max_tokens}
    body["kv_transfer_params"] = params
    response = httpx.post(
        sc.url + "/v1/completions", json=body, headers={"x-request-id": request_id}, timeout=10
    )
    return response.status_code


@pytest.mark.nixl
@pytest.mark.parametrize(
    ("version", "engine_kind", "engine_id"),
    [("0.33.0", "notify", None), ("0.11.0", "legacy", "cmpl-rej-1-0")],
)
def test_http_release_frees_p_through_d(version: str, engine_kind: str, engine_id: str | None) -> None:
    with pd(version, engine_kind) as (p, engine, sc):
        params = prefill(p, "rej-1")
        assert decode(sc, "rej-1", params, max_tokens="x") == 400  # validation: before D's handler
        after = wait_stats(p, lambda s: s["pinned_requests"] == 0)
        assert after["freed_by_notification"] == 1 and after["notifs_per_rank"] == [1, 1]
        assert after["notifs_unknown"] == 0
        sc.settle()
        assert sc.sample("kvr_releases_total", strategy="http", result="sent") == 1
        # P's id for the request: remote_request_id from 0.13.0, D's own engine id before.
        expected = engine_id or params["remote_request_id"]
        sent = engine.notified[0][0] if isinstance(engine, NotifyEngine) else engine.submitted[0][0]
        assert sent == expected


@pytest.mark.nixl
def test_http_leaves_handler_rejections_to_d_own_fix() -> None:
    with pd("0.33.0", "notify") as (p, engine, sc):
        params = prefill(p, "fix-1")
        assert decode(sc, "fix-1", params, words=80) == 400  # prompt too long: inside D's handler
        after = wait_stats(p, lambda s: s["pinned_requests"] == 0)
        sc.settle()
        assert after["notifs_per_rank"] == [1, 1] and after["notifs_unknown"] == 0  # D's fix alone
        assert engine.notified == []
        assert sc.sample("kvr_releases_total", strategy="http", result="covered_by_engine") == 1


@pytest.mark.nixl
def test_auto_releases_over_real_nixl_when_d_is_down() -> None:
    p_config = PrefillSimConfig(
        port=0, vllm_version="0.33.0", tp=2, num_blocks=256, lease=0, side_channel_port=0
    )
    with serve(create_prefill_app(p_config)) as p:
        d_url = f"http://127.0.0.1:{free_port()}"
        with run_auto(d_url, vllm_version="0.33.0", prefill_allow=("127.0.0.1",)) as sc:
            assert sc.app.runtime.releaser.probed == "unreachable"  # type: ignore[union-attr]
            params = prefill(p, "down-1")
            assert decode(sc, "down-1", params) == 503
            after = wait_stats(p, lambda s: s["pinned_requests"] == 0)
            sc.settle()
            assert after["notifs_per_rank"] == [1, 1] and after["notifs_unknown"] == 0
            assert sc.sample("kvr_auto_releases_total", path="nixl", result="sent") == 1
            assert sc.sample("kvr_nixl_releases_total", outcome="sent") == 1
