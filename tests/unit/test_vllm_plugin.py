"""The vLLM plugin in-process: settings, engine actions, auth, validation, idempotency, both forms.

Apps are driven through httpx's ASGI transport (no sockets); the real-server
versions of these paths are in ``tests/integration/test_vllm_plugin.py``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import subprocess
import sys
from argparse import Namespace
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from sidecar.vllm_plugin import (
    HEALTH_PATH,
    RELEASE_PATH,
    KVReleaseMiddleware,
    KVReleasePlugin,
    PluginSettings,
)
from sidecar.vllm_plugin.engine import action_of, emulate
from sidecar.vllm_plugin.service import ControlService
from tests.support.fake_engine import LegacyEngine, NotifyEngine, sampling_params

TOKEN = "t0ken-for-tests-0123456789"
AUTH = {"authorization": f"Bearer {TOKEN}"}
PARAMS: dict[str, Any] = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_engine_id": "p-engine",
    "remote_request_id": "cmpl-abc-0-1a2b3c4d",
    "remote_host": "10.0.0.7",
    "remote_port": 5600,
    "remote_block_ids": [[1, 2, 3]],
    "tp_size": 2,
    "future_field": {"kept": True},  # unknown to the sidecar: passed to the engine unchanged
}
SETTINGS = PluginSettings(token=TOKEN, emulate_grace=0.05, emulate_settle=0.05)


def fastapi_app(engine: object | None, settings: PluginSettings = SETTINGS) -> FastAPI:
    """Mounted as vLLM 0.26.0+ mounts it: attach_router in build_app, engine on app.state."""
    app = FastAPI()
    KVReleasePlugin(settings, sampling_params=sampling_params).attach_router(app)
    app.state.engine_client = engine
    return app


def middleware_app(engine: object | None, settings: PluginSettings = SETTINGS) -> Starlette:
    """Mounted as ``--middleware`` mounts it: ``app.add_middleware(cls)``."""
    app = Starlette(routes=[Route("/health", lambda request: PlainTextResponse("vllm"))])
    app.add_middleware(KVReleaseMiddleware, settings=settings, sampling_params=sampling_params)
    app.state.engine_client = engine
    return app


async def post(
    app: Any, body: Any, headers: dict[str, Any] | None = None, path: str = RELEASE_PATH
) -> httpx.Response:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://d") as client:
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        return await client.post(path, content=content, headers=AUTH if headers is None else headers)


def release_body(request_id: str = "cmpl-abc-0-1a2b3c4d", rank: int | None = None) -> dict[str, Any]:
    return {"request_id": request_id, "kv_transfer_params": PARAMS, "data_parallel_rank": rank}


# --- settings --------------------------------------------------------------------------------


def test_settings_from_environ(tmp_path: Path) -> None:
    secret = tmp_path / "token"
    secret.write_text(f"  {TOKEN}\n")
    assert PluginSettings.from_environ({"KVR_CONTROL_TOKEN": TOKEN}).token == TOKEN
    from_file = PluginSettings.from_environ({"KVR_CONTROL_TOKEN_FILE": str(secret)})
    assert from_file.token == TOKEN and from_file.enabled
    both = PluginSettings.from_environ(
        {"KVR_CONTROL_TOKEN": "from-env", "KVR_CONTROL_TOKEN_FILE": str(secret)}
    )
    assert both.token == "from-env"
    assert TOKEN not in repr(from_file)


@pytest.mark.parametrize(
    ("environ", "reason"),
    [
        ({}, "no token: set KVR_CONTROL_TOKEN or KVR_CONTROL_TOKEN_FILE"),
        ({"KVR_CONTROL_TOKEN_FILE": "/nonexistent/token"}, "cannot be read"),
        ({"KVR_CONTROL_TOKEN_FILE": "/nonexistent/token", "KVR_CONTROL_INSECURE": "1"}, "cannot be read"),
        ({"KVR_CONTROL_INSECURE": "0"}, "no token"),
    ],
)
def test_settings_without_a_usable_token_disable_the_route(environ: dict[str, str], reason: str) -> None:
    settings = PluginSettings.from_environ(environ)
    assert not settings.enabled
    assert reason in settings.disabled_reason()


def test_settings_insecure_serves_without_a_token() -> None:
    settings = PluginSettings.from_environ({"KVR_CONTROL_INSECURE": "1"})
    assert settings.enabled and not settings.token


def test_empty_token_file_disables(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.write_text("\n")
    settings = PluginSettings.from_environ({"KVR_CONTROL_TOKEN_FILE": str(empty)})
    assert not settings.enabled and "is empty" in settings.problem


# --- import weight and registration ----------------------------------------------------------


def test_import_is_light() -> None:
    code = (
        "import sys, sidecar.vllm_plugin\n"
        "heavy = ('zmq', 'aiohttp', 'httpx', 'uvicorn', 'vllm', 'fastapi', 'sidecar.proxy', 'sidecar.app',"
        " 'sidecar.release', 'sidecar.release.nixl', 'sidecar.upstream')\n"
        "bad = sorted(m for m in sys.modules\n"
        "             if m.startswith('nixl') or m in heavy or m.split('.')[0] in heavy)\n"
        "print(bad)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert done.stdout.strip() == "[]", done.stdout


def test_entry_point_names_the_plugin_factory() -> None:
    found = [ep for ep in entry_points(group="vllm.endpoint_plugins") if ep.name == "kv_release"]
    assert len(found) == 1
    assert found[0].load() is KVReleasePlugin
    plugin = KVReleasePlugin(SETTINGS)
    assert plugin.name == "kv_release" and plugin.required_tasks == ("generate",)


# --- engine actions --------------------------------------------------------------------------


def test_action_of() -> None:
    assert action_of(NotifyEngine()) == "notify"
    assert action_of(LegacyEngine()) == "emulate"
    assert action_of(object()) is None


@pytest.mark.parametrize(
    ("mode", "outcome"), [("hang", "aborted"), ("finish", "aborted"), ("admit", "admitted")]
)
async def test_emulate_submits_one_token_and_aborts(mode: Any, outcome: str) -> None:
    engine = LegacyEngine(mode)
    got = await emulate(engine, "rid-1", PARAMS, 1, make_sampling_params=sampling_params, waits=(0.05, 0.05))
    assert got == outcome
    assert engine.submitted == [("rid-1", {"prompt_token_ids": [0]}, PARAMS, 1)]
    assert engine.released == ["rid-1"]  # exactly one release whichever order won
    assert engine.closed == ["rid-1"]  # the stream was cleaned up, never left running
    if mode != "admit":
        assert engine.aborted[0] == "rid-1"


async def test_emulate_passes_the_rank_only_when_given() -> None:
    engine = LegacyEngine("finish")
    await emulate(engine, "a", PARAMS, None, make_sampling_params=sampling_params, waits=(0.01, 1))
    await emulate(engine, "b", PARAMS, 0, make_sampling_params=sampling_params, waits=(0.01, 1))
    assert engine.keywords == [{}, {"data_parallel_rank": 0}]  # 0.9.2's EngineClient.generate lacks it


# --- the route -------------------------------------------------------------------------------


@pytest.mark.parametrize("mount", [fastapi_app, middleware_app])
async def test_release_notifies_engine(mount: Any) -> None:
    engine = NotifyEngine()
    response = await post(mount(engine), release_body(rank=3))
    assert response.status_code == 202, response.text
    assert response.json() == {
        "request_id": "cmpl-abc-0-1a2b3c4d",
        "action": "notify",
        "outcome": "notified",
        "duplicate": False,
    }
    assert engine.notified == [("cmpl-abc-0-1a2b3c4d", PARAMS, 3)]


@pytest.mark.parametrize("mount", [fastapi_app, middleware_app])
async def test_release_emulates_on_old_engine(mount: Any) -> None:
    engine = LegacyEngine("hang")
    response = await post(mount(engine), release_body())
    assert response.status_code == 202
    assert response.json()["action"] == "emulate" and response.json()["outcome"] == "aborted"
    assert engine.released == ["cmpl-abc-0-1a2b3c4d"]


@pytest.mark.parametrize(
    ("headers", "status", "kind"),
    [
        ({}, 401, "unauthorized"),
        ({"authorization": "Basic abc"}, 401, "unauthorized"),
        ({"authorization": "Bearer "}, 401, "unauthorized"),
        ({"authorization": "Bearer wrong-token"}, 403, "forbidden"),
        ({"authorization": f"Bearer {TOKEN}x"}, 403, "forbidden"),
        ({"authorization": "Bearer tökén".encode("latin-1")}, 403, "forbidden"),  # non-ASCII: no crash
    ],
)
async def test_auth(
    headers: dict[str, Any], status: int, kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    engine = NotifyEngine()
    app = fastapi_app(engine)
    with caplog.at_level(logging.WARNING, logger="vllm.kv_release"):
        response = await post(app, release_body(), headers)
    assert response.status_code == status
    assert response.json()["error"]["code"] == status
    if status == 401:
        assert response.headers["www-authenticate"] == "Bearer"
    assert engine.notified == []
    service = app.state.kv_release_control
    assert service.counts[kind] == 1
    assert TOKEN not in caplog.text and "wrong-token" not in caplog.text
    assert kind in caplog.text  # the rejection is logged (rate-limited)


@pytest.mark.parametrize(
    ("body", "param", "fragment"),
    [
        (b"{not json", None, "not JSON"),
        ({"kv_transfer_params": PARAMS}, None, "request_id"),
        ({"request_id": "", "kv_transfer_params": PARAMS}, "request_id", "length"),
        ({"request_id": 7, "kv_transfer_params": PARAMS}, "request_id", "Expected `str`"),
        ({"request_id": "r", "kv_transfer_params": [1]}, "kv_transfer_params", "Expected `object`"),
        (
            {"request_id": "r", "kv_transfer_params": PARAMS, "data_parallel_rank": -1},
            "data_parallel_rank",
            ">= 0",
        ),
        (
            {"request_id": "r", "kv_transfer_params": {**PARAMS, "remote_port": "x"}},
            "kv_transfer_params.remote_port",
            "Expected `int",
        ),
        (
            {"request_id": "r", "kv_transfer_params": {**PARAMS, "do_remote_prefill": False}},
            "kv_transfer_params.do_remote_prefill",
            "not true",
        ),
    ],
)
async def test_bad_bodies(body: Any, param: str | None, fragment: str) -> None:
    engine = NotifyEngine()
    response = await post(fastapi_app(engine), body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "BadRequestError" and error["code"] == 400
    assert error["param"] == param
    assert fragment in error["message"]
    assert engine.notified == []


async def test_oversized_body_is_413() -> None:
    settings = PluginSettings(token=TOKEN, max_body_bytes=100)
    response = await post(fastapi_app(NotifyEngine(), settings), release_body())
    assert response.status_code == 413


@pytest.mark.parametrize("engine", [None, object()])
async def test_no_engine_is_503(engine: object | None) -> None:
    response = await post(fastapi_app(engine), release_body())
    assert response.status_code == 503
    assert response.json()["error"]["type"] == "ServiceUnavailableError"


@pytest.mark.parametrize(
    ("engine", "status"),
    [
        (NotifyEngine(fail=ValueError("data_parallel_rank 9 out of range")), 400),
        # vLLM 0.21.0-0.33.0 DPLBAsyncMPClient: core_engines[rank] with a rank past the DP size
        (NotifyEngine(fail=IndexError("list index out of range")), 400),
        (NotifyEngine(fail=RuntimeError("EngineDeadError")), 503),
        (LegacyEngine("refuse"), 400),
    ],
)
async def test_engine_failures(engine: object, status: int) -> None:
    app = fastapi_app(engine)
    response = await post(app, release_body())
    assert response.status_code == status
    # A failed attempt is forgotten: the same id is tried again, not answered "duplicate".
    assert app.state.kv_release_control._recent == {}


async def test_idempotent_per_request_id() -> None:
    engine = NotifyEngine()
    app = fastapi_app(engine)
    first = await post(app, release_body("r-1"))
    again = await post(app, release_body("r-1"))
    other = await post(app, release_body("r-2"))
    assert (first.status_code, again.status_code, other.status_code) == (202, 202, 202)
    assert again.json()["duplicate"] is True and first.json()["duplicate"] is False
    assert [call[0] for call in engine.notified] == ["r-1", "r-2"]


async def test_concurrent_duplicates_act_once() -> None:
    engine = NotifyEngine()
    engine.gate = asyncio.Event()
    app = fastapi_app(engine)
    calls = [asyncio.create_task(post(app, release_body("r-1"))) for _ in range(5)]
    deadline = asyncio.get_running_loop().time() + 5
    while not app.state.kv_release_control._recent:
        assert asyncio.get_running_loop().time() < deadline
        await asyncio.sleep(0.001)
    engine.gate.set()
    responses = await asyncio.gather(*calls)
    assert [r.status_code for r in responses] == [202] * 5
    assert sorted(r.json()["duplicate"] for r in responses) == [False, True, True, True, True]
    assert len(engine.notified) == 1


async def test_retry_after_failure_acts_again() -> None:
    engine = NotifyEngine(fail=RuntimeError("engine busy"))
    app = fastapi_app(engine)
    assert (await post(app, release_body())).status_code == 503
    engine.fail = None
    response = await post(app, release_body())
    assert response.status_code == 202 and response.json()["duplicate"] is False
    assert len(engine.notified) == 1


async def test_recent_ids_are_bounded() -> None:
    engine = NotifyEngine()
    app = fastapi_app(engine, PluginSettings(token=TOKEN, recent_size=2))
    for rid in ("a", "b", "c", "a"):
        assert (await post(app, release_body(rid))).status_code == 202
    assert [call[0] for call in engine.notified] == ["a", "b", "c", "a"]  # "a" was evicted


async def test_health() -> None:
    transport = httpx.ASGITransport(app=fastapi_app(NotifyEngine()))
    async with httpx.AsyncClient(transport=transport, base_url="http://d") as client:
        denied = await client.get(HEALTH_PATH)
        ok = await client.get(HEALTH_PATH, headers=AUTH)
    assert denied.status_code == 401
    assert ok.status_code == 200
    assert ok.json()["status"] == "ok" and ok.json()["action"] == "notify"
    assert ok.json()["counts"] == {"unauthorized": 1}


# --- the two forms ---------------------------------------------------------------------------


async def test_middleware_passes_other_paths_and_honours_root_path() -> None:
    engine = NotifyEngine()
    app = middleware_app(engine)
    transport = httpx.ASGITransport(app=app, root_path="/vllm")
    async with httpx.AsyncClient(transport=transport, base_url="http://d") as client:
        assert (await client.get("/vllm/health")).text == "vllm"
        response = await client.post("/vllm" + RELEASE_PATH, json=release_body(), headers=AUTH)
        unknown = await client.post("/vllm/kv_release/v1/other", headers=AUTH)
        wrong_method = await client.get("/vllm" + RELEASE_PATH, headers=AUTH)
    assert response.status_code == 202 and len(engine.notified) == 1
    assert unknown.status_code == 404 and wrong_method.status_code == 405


@pytest.mark.parametrize("mount", [fastapi_app, middleware_app])
async def test_without_token_the_route_is_not_served(mount: Any, caplog: pytest.LogCaptureFixture) -> None:
    engine = NotifyEngine()
    with caplog.at_level(logging.ERROR, logger="vllm.kv_release"):
        app = mount(engine, PluginSettings())
        response = await post(app, release_body(), headers={})  # the middleware logs when it is built
    assert response.status_code == 404
    assert engine.notified == []
    assert "NOT served" in caplog.text and "KVR_CONTROL_TOKEN" in caplog.text


async def test_insecure_serves_without_auth(caplog: pytest.LogCaptureFixture) -> None:
    engine = NotifyEngine()
    with caplog.at_level(logging.WARNING, logger="vllm.kv_release"):
        app = fastapi_app(engine, PluginSettings(insecure=True))
    assert (await post(app, release_body(), headers={})).status_code == 202
    assert "WITHOUT authentication" in caplog.text


async def test_both_forms_share_one_service() -> None:
    engine = NotifyEngine()
    app = FastAPI()
    plugin = KVReleasePlugin(SETTINGS)
    plugin.attach_router(app)
    app.add_middleware(KVReleaseMiddleware, settings=SETTINGS)
    app.state.engine_client = engine
    await plugin.init_state(engine, app.state, Namespace())
    assert (await post(app, release_body("r"))).json()["duplicate"] is False
    assert (await post(app, release_body("r"))).json()["duplicate"] is True
    assert isinstance(app.state.kv_release_control, ControlService)
    assert len(engine.notified) == 1


async def test_init_state_logs_how_it_releases(caplog: pytest.LogCaptureFixture) -> None:
    plugin = KVReleasePlugin(SETTINGS)
    with caplog.at_level(logging.INFO, logger="vllm.kv_release"):
        await plugin.init_state(NotifyEngine(), Namespace(), Namespace())
        await plugin.init_state(LegacyEngine(), Namespace(), Namespace())
        await plugin.init_state(None, Namespace(), Namespace())
    assert "notify_kv_transfer_request_rejected" in caplog.text
    assert "one-token request" in caplog.text
    assert "no usable engine client" in caplog.text


async def test_middleware_keeps_its_service_on_an_empty_app_state() -> None:
    """``app.state`` starts empty (and an empty State is falsy): the service must still live there."""
    app = Starlette()
    app.add_middleware(KVReleaseMiddleware, settings=SETTINGS)
    response = await post(app, release_body())
    assert response.status_code == 503  # no engine yet
    assert isinstance(app.state.kv_release_control, ControlService)
