"""The decode simulator's engine modes (dead, shutting down, no KV connector), in-process.

What each mode answers and that the simulated D then notifies P for nothing:
the hooks a "vLLM D" plugs into (``--vllm-d``) are never called.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import pytest

from sidecar.config import ConfigError
from sidecar.sim.decode import DecodeSimConfig, add_arguments
from sidecar.sim.decode.config import config_from_args
from sidecar.sim.decode.engine import CLIENT_MESSAGE, ENGINE_DEAD_MESSAGE
from tests.unit.sim_decode import (
    CHAT,
    COMPLETIONS,
    REMOTE,
    RESPONSES,
    RecordingHooks,
    body_for,
    log,
    post,
    sim,
)

ROUTES = (CHAT, COMPLETIONS, RESPONSES)


def remote(route: str, text: str = "hello there world", **extra: Any) -> dict[str, Any]:
    return body_for(route, text, kv_transfer_params=REMOTE, **extra)


# --- dead -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("version", "message"), [("0.33.0", CLIENT_MESSAGE), ("0.29.0", ENGINE_DEAD_MESSAGE)]
)
@pytest.mark.parametrize("stream", [False, True])
async def test_dead_engine_answers_500_with_the_releases_message_and_notifies_nobody(
    version: str, message: str, stream: bool
) -> None:
    hooks = RecordingHooks()
    async with sim(hooks, engine="dead", version=version) as client:
        health = await client.get("/health")
        answers = [await post(client, route, remote(route, stream=stream), rid=route) for route in ROUTES]
        entries = await log(client)
    assert health.status_code == 503
    for answer in answers:
        assert answer.status_code == 500
        assert answer.json() == {
            "error": {"message": message, "type": "InternalServerError", "param": None, "code": 500}
        }
    assert [(e["outcome"], e["origin"]) for e in entries] == [("rejected", "handler")] * 3
    assert hooks.calls == []


async def test_dead_engine_still_checks_the_model_first_without_notifying() -> None:
    hooks = RecordingHooks()
    async with sim(hooks, engine="dead") as client:
        answer = await post(client, CHAT, {**remote(CHAT), "model": "other"})
    assert (answer.status_code, answer.json()["error"]["type"]) == (404, "NotFoundError")
    assert hooks.calls == []


# --- shutting down --------------------------------------------------------------------------


async def test_shutting_down_engine_aborts_admitted_requests_and_notifies_nobody() -> None:
    hooks = RecordingHooks()
    async with sim(hooks, engine="shutting_down") as client:
        health = await client.get("/health")
        chat = await post(client, CHAT, remote(CHAT), rid="a")
        stream = await post(client, COMPLETIONS, remote(COMPLETIONS, stream=True), rid="b")
        rejected = await post(client, CHAT, remote(CHAT, "[[reject:400]]"), rid="c")
        entries = await log(client)
    assert health.status_code == 200
    choice = chat.json()["choices"][0]
    assert (chat.status_code, choice["finish_reason"], choice["message"]["content"]) == (200, "abort", "")
    assert chat.json()["usage"]["completion_tokens"] == 0
    events = [block for block in stream.text.split("\n\n") if block]
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2].removeprefix("data: "))["choices"][0]["finish_reason"] == "abort"
    assert rejected.status_code == 400
    assert [(e["outcome"], e["admitted"]) for e in entries] == [
        ("aborted", False),
        ("aborted", False),
        ("rejected", False),
    ]
    assert hooks.calls == []


@pytest.mark.parametrize(("version", "closing"), [("0.25.1", True), ("0.27.0", True), ("0.28.0", False)])
async def test_shutdown_shows_connection_close_only_before_vllm_0_28(version: str, closing: bool) -> None:
    async with sim(engine="shutting_down", version=version) as client:
        health = await client.get("/health")
        answer = await post(client, CHAT, remote(CHAT))
        await client.post("/sim/engine", json={"engine": "alive"})
        after = await client.get("/health")
    for response in (health, answer):
        assert (response.headers.get("connection") == "close") is closing
    assert "connection" not in after.headers


# --- no KV connector ------------------------------------------------------------------------


async def test_without_a_kv_connector_d_never_notifies_and_metrics_show_no_nixl() -> None:
    hooks = RecordingHooks()
    async with sim(hooks, kv_connector=False, prompt_tokens_details=True) as client:
        admitted = await post(client, CHAT, remote(CHAT), rid="a")
        await post(client, CHAT, remote(CHAT, "[[reject:400]]"), rid="b")
        metrics = (await client.get("/metrics")).text
    # D ignored P's parameters and prefilled itself: nothing of the prompt came from P's cache.
    assert admitted.status_code == 200
    assert admitted.json()["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert hooks.calls == []
    assert "vllm:num_requests_running" in metrics and "vllm:nixl_" not in metrics


async def test_with_a_kv_connector_metrics_list_nixl_families_while_stats_are_on() -> None:
    async with sim() as client:
        with_stats = (await client.get("/metrics")).text
    async with sim(log_stats=False) as client:
        without_stats = (await client.get("/metrics")).text
    assert "# TYPE vllm:nixl_xfer_time_seconds histogram" in with_stats
    assert "vllm:" not in without_stats and "sim_decode_requests_total" in without_stats


# --- switching at run time ------------------------------------------------------------------


async def test_sim_engine_route_switches_modes_and_back() -> None:
    hooks = RecordingHooks()
    async with sim(hooks) as client:
        assert (await client.get("/sim/engine")).json() == {"engine": "alive", "kv_connector": True}
        switched = await client.post("/sim/engine", json={"engine": "dead"})
        dead = await client.get("/health")
        await post(client, CHAT, remote(CHAT), rid="a")
        await client.post("/sim/engine", json={"engine": "alive", "kv_connector": False})
        await post(client, CHAT, remote(CHAT), rid="b")
        back = await client.post("/sim/engine", json={"kv_connector": True})
        await post(client, CHAT, remote(CHAT), rid="c")
    assert switched.json() == {"engine": "dead", "kv_connector": True} and dead.status_code == 503
    assert back.json() == {"engine": "alive", "kv_connector": True}
    assert [call[:2] for call in hooks.calls] == [("admitted", "c")]


@pytest.mark.parametrize(
    "body",
    [{"engine": "zombie"}, {"kv_connector": "no"}, {"other": 1}, [], "dead"],
)
async def test_sim_engine_route_refuses_bad_changes(body: Any) -> None:
    async with sim() as client:
        answer = await client.post("/sim/engine", json=body)
        bad_json = await client.post("/sim/engine", content=b"{")
        state = (await client.get("/sim/engine")).json()
    assert answer.status_code == 400 and "detail" in answer.json()
    assert bad_json.status_code == 400
    assert state == {"engine": "alive", "kv_connector": True}


def test_engine_flags_mirror_config() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--engine", "shutting_down", "--no-kv-connector", "--disable-log-stats"])
    assert config_from_args(args) == DecodeSimConfig(
        engine="shutting_down", kv_connector=False, log_stats=False
    )


def test_config_refuses_an_unknown_engine_mode() -> None:
    with pytest.raises(ConfigError) as caught:
        DecodeSimConfig(engine="zombie")  # type: ignore[arg-type]
    assert caught.value.field == "engine"
