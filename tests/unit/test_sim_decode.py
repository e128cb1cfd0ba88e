"""The decode simulator's rules and knobs, driven in-process through httpx's ASGI transport."""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import Any

import httpx
import pytest

from sidecar.cli import build_parser, main
from sidecar.config import ConfigError
from sidecar.sim.decode import DecodeSimConfig, SimulatedDrop, add_arguments
from sidecar.sim.decode.config import config_from_args
from sidecar.sim.decode.rejections import HANDLER_ERROR_TYPES
from sidecar.sim.decode.rules import Markers, ParsedRequest, Rejection, decode_view, read_markers, validate
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


async def logged(client: httpx.AsyncClient) -> list[dict[str, Any]]:
    """Poll /sim/log until a request has reached the simulator (bounded)."""
    for _ in range(500):
        if entries := await log(client):
            return entries
        await asyncio.sleep(0.01)
    raise AssertionError("the request never reached the simulator")


def data_events(text: str) -> list[str]:
    return [block.removeprefix("data: ") for block in text.split("\n\n") if block.startswith("data: ")]


# --- happy path -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("route", "id_prefix", "kind"),
    [
        (CHAT, "chatcmpl-", "chat.completion"),
        (COMPLETIONS, "cmpl-", "text_completion"),
        (RESPONSES, "resp_", "response"),
    ],
)
async def test_non_stream_answer_is_vllm_shaped(route: str, id_prefix: str, kind: str) -> None:
    async with sim(stream_events=5) as client:
        response = await post(client, route, body_for(route, "one two three"), rid="abc")
    assert response.status_code == 200
    assert response.headers["x-request-id"] == "abc"
    assert response.headers["content-type"] == "application/json"
    answer = response.json()
    assert (answer["id"], answer["object"], answer["model"]) == (id_prefix + "abc", kind, "sim-model")
    usage = answer["usage"]
    if route == RESPONSES:
        assert (usage["input_tokens"], usage["output_tokens"], usage["total_tokens"]) == (3, 5, 8)
        assert answer["output"][0]["content"][0]["text"] == "t0 t1 t2 t3 t4"
    else:
        assert (usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]) == (3, 5, 8)
        assert usage["prompt_tokens_details"] is None
        assert answer["choices"][0]["finish_reason"] == "stop"


async def test_prompt_tokens_details_when_enabled() -> None:
    async with sim(prompt_tokens_details=True) as client:
        response = await post(client, CHAT, body_for(CHAT))
    assert response.json()["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}


async def test_missing_request_id_is_generated_and_echoed() -> None:
    async with sim() as client:
        response = await client.post(CHAT, json=body_for(CHAT))
        entries = await log(client)
    request_id = response.headers["x-request-id"]
    assert len(request_id) == 32 and int(request_id, 16) >= 0
    assert response.json()["id"] == f"chatcmpl-{request_id}"
    assert entries[0]["request_id"] == request_id


@pytest.mark.parametrize("events", [1, 8, 64])
async def test_chat_stream_has_configured_events_then_done(events: int) -> None:
    async with sim(stream_events=events) as client:
        response = await post(client, CHAT, body_for(CHAT, stream=True))
    assert response.headers["content-type"].startswith("text/event-stream")
    chunks = data_events(response.text)
    assert len(chunks) == events + 1 and chunks[-1] == "[DONE]"
    parsed = [json.loads(chunk) for chunk in chunks[:-1]]
    assert parsed[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "".join(chunk["choices"][0]["delta"]["content"] for chunk in parsed).split() == [
        f"t{i}" for i in range(events)
    ]
    assert [chunk["choices"][0]["finish_reason"] for chunk in parsed][-1] == "stop"
    assert {chunk["object"] for chunk in parsed} == {"chat.completion.chunk"}


async def test_completion_stream_with_usage_ends_with_usage_chunk() -> None:
    async with sim(stream_events=3) as client:
        body = body_for(COMPLETIONS, "a b", stream=True, stream_options={"include_usage": True})
        response = await post(client, COMPLETIONS, body)
    chunks = data_events(response.text)
    assert len(chunks) == 5 and chunks[-1] == "[DONE]"
    assert [json.loads(c)["choices"][0]["text"] for c in chunks[:3]] == ["t0", " t1", " t2"]
    usage_chunk = json.loads(chunks[3])
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"] == {"prompt_tokens": 2, "total_tokens": 5, "completion_tokens": 3}


async def test_responses_stream_is_vllm_0_33_event_sequence_without_done() -> None:
    async with sim(stream_events=2) as client:
        response = await post(client, RESPONSES, body_for(RESPONSES, stream=True))
    frames = [frame for frame in response.text.split("\n\n") if frame]
    types = [frame.split("\n")[0].removeprefix("event: ") for frame in frames]
    data = [json.loads(frame.split("\n")[1].removeprefix("data: ")) for frame in frames]
    assert types == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [event["type"] for event in data] == types
    assert [event["sequence_number"] for event in data] == list(range(len(types)))
    assert data[2]["item"] == {
        "id": data[4]["item_id"],
        "content": [],
        "role": "assistant",
        "status": "in_progress",
        "type": "message",
    }
    assert (
        data[6]["text"]
        == "t0 t1"
        == data[7]["part"]["text"]
        == data[9]["response"]["output"][0]["content"][0]["text"]
    )
    assert (data[0]["response"]["status"], data[9]["response"]["status"]) == ("in_progress", "completed")
    assert "[DONE]" not in response.text


# --- token counting and markers (pure) ------------------------------------------------------


@pytest.mark.parametrize(
    ("route", "body", "tokens"),
    [
        (CHAT, {"messages": [{"role": "user", "content": "a b"}, {"role": "user", "content": " c "}]}, 3),
        (CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": "a b c d"}]}]}, 4),
        (CHAT, {"messages": [{"role": "assistant", "content": None}]}, 0),
        (COMPLETIONS, {"prompt": "one  two\nthree"}, 3),
        (COMPLETIONS, {"prompt": [5, 6, 7, 8, 9]}, 5),
        (COMPLETIONS, {"prompt": [[1, 2], [3]]}, 3),
        (COMPLETIONS, {"prompt": ["a b", "c"]}, 3),
        (RESPONSES, {"input": "x y"}, 2),
        (RESPONSES, {"input": [{"role": "user", "content": "x y z"}]}, 3),
    ],
)
def test_prompt_length_is_word_count(route: str, body: dict[str, Any], tokens: int) -> None:
    view = decode_view(json.dumps(body).encode())
    assert not isinstance(view, Rejection)
    parsed = validate(route, view)
    assert isinstance(parsed, ParsedRequest)
    assert parsed.prompt_tokens == tokens


@pytest.mark.parametrize(
    ("text", "markers"),
    [
        ("plain text", Markers()),
        ("x [[reject:503]] y", Markers(reject=503)),
        ("[[stream-error:400]]", Markers(stream_error=400)),
        ("[[slow-headers:0.25]]", Markers(slow_headers=0.25)),
        ("[[hang]] and [[drop-mid-stream]]", Markers(hang=True, drop_mid_stream=True)),
        ("[[reject:422]] [[reject:500]]", Markers(reject=422)),
        ("[[reject:200]] [[reject:abc]] [[other]]", Markers()),
    ],
)
def test_read_markers(text: str, markers: Markers) -> None:
    assert read_markers(text) == markers


# --- pre-handler rejections -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("route", "content", "param", "fragment"),
    [
        (CHAT, b"{not json", "body.1", "json_invalid"),
        (CHAT, b"[1, 2]", "body", "valid dictionary or object"),
        (CHAT, b'{"model": "sim-model"}', "body.messages", "Field required"),
        (CHAT, b'{"messages": "hi"}', "body.messages", "valid list"),
        (CHAT, b'{"messages": [], "stream": "maybe"}', "body.stream", "valid boolean"),
        (
            CHAT,
            b'{"messages": [], "max_tokens": "ten"}',
            "body.max_tokens",
            "unable to parse string as an integer",
        ),
        (CHAT, b'{"messages": [], "temperature": "hot"}', "body.temperature", "valid number"),
        (CHAT, b'{"messages": [], "kv_transfer_params": [1]}', "body.kv_transfer_params", "an object"),
        (COMPLETIONS, b'{"model": "sim-model"}', "prompt", "Either prompt or prompt_embeds"),
        (
            COMPLETIONS,
            b'{"prompt": "hi", "stream_options": {"include_usage": true}}',
            "stream_options",
            "Stream options can only be defined when `stream=True`.",
        ),
        (
            CHAT,
            b'{"messages": [], "stream": false, "stream_options": {"include_usage": true}}',
            "stream_options",
            "Stream options can only be defined",
        ),
        (COMPLETIONS, b'{"prompt": {"a": 1}}', "body.prompt", "valid string"),
        (RESPONSES, b'{"model": "sim-model"}', "body.input", "Field required"),
    ],
)
async def test_invalid_body_is_400_bad_request_before_handler(
    route: str, content: bytes, param: str, fragment: str
) -> None:
    hooks = RecordingHooks()
    async with sim(hooks, version="0.26.0") as client:  # before 0.27.0 vLLM's validators raise ValueError
        response = await client.post(route, content=content, headers={"content-type": "application/json"})
        entries = await log(client)
    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["type"], error["code"], error["param"]) == ("Bad Request", 400, param)
    assert error["message"].startswith("1 validation error:") and fragment in error["message"]
    assert entries[0]["origin"] == "pre_handler" and entries[0]["outcome"] == "rejected"
    assert hooks.calls == []


@pytest.mark.parametrize("route", [CHAT, COMPLETIONS])
async def test_from_0_27_a_validators_error_is_typed_as_a_handlers_and_still_before_it(route: str) -> None:
    hooks = RecordingHooks()
    async with sim(hooks, version="0.27.0") as client:
        response = await post(client, route, {**body_for(route), "stream_options": {"include_usage": True}})
        entries = await log(client)
    assert response.status_code == 400
    assert response.json()["error"] == {
        "message": "Stream options can only be defined when `stream=True`. (parameter=stream_options)",
        "type": "BadRequestError",
        "param": "stream_options",
        "code": 400,
    }
    assert entries[0]["origin"] == "pre_handler" and hooks.calls == []


async def test_invalid_body_with_remote_prefill_params_is_logged_without_hook() -> None:
    hooks = RecordingHooks()
    async with sim(hooks, log_params=True) as client:
        body = {"messages": "oops", "kv_transfer_params": REMOTE, "stream": True}
        response = await post(client, CHAT, body)
        entries = await log(client)
    assert response.status_code == 400
    assert entries[0]["kv_transfer_params"] == REMOTE and entries[0]["stream"] is True
    assert hooks.calls == []


async def test_wrong_content_type_is_400() -> None:
    async with sim() as client:
        response = await client.post(
            CHAT, content=b'{"messages": []}', headers={"content-type": "text/plain"}
        )
    assert response.status_code == 400
    assert "Only 'application/json' is allowed" in response.json()["error"]["message"]


@pytest.mark.parametrize(
    "headers", [{}, {"authorization": "Bearer wrong"}, {"authorization": "Basic secret"}]
)
async def test_api_key_refusal_is_401_unauthorized(headers: dict[str, str]) -> None:
    hooks = RecordingHooks()
    async with sim(hooks, api_key="secret") as client:
        response = await post(client, CHAT, body_for(CHAT, kv_transfer_params=REMOTE), headers=headers)
        models = await client.get("/v1/models", headers=headers)
        entries = await log(client)
    assert response.status_code == 401 and response.json() == {"error": "Unauthorized"}
    assert response.headers["x-request-id"] == "r1"
    assert models.status_code == 401
    assert entries == [
        {
            "request_id": "r1",
            "route": CHAT,
            "outcome": "rejected",
            "status": 401,
            "origin": "pre_handler",
            "admitted": False,
            "stream": False,
            "kv_transfer_params": None,  # parameters are logged only with log_params
        }
    ]
    assert hooks.calls == []


async def test_api_key_accepted_and_health_unguarded() -> None:
    async with sim(api_key="secret") as client:
        ok = await post(client, CHAT, body_for(CHAT), headers={"authorization": "bearer secret"})
        health = await client.get("/health")
    assert ok.status_code == 200 and health.status_code == 200


async def test_scaling_answers_503_except_health_and_sim() -> None:
    async with sim(scaling=True) as client:
        response = await post(client, COMPLETIONS, body_for(COMPLETIONS))
        health = await client.get("/health")
        entries = await log(client)
    assert response.status_code == 503
    assert response.json() == {"error": "The model is currently scaling. Please try again later."}
    assert health.status_code == 200
    assert entries[0]["origin"] == "pre_handler"


async def test_disabled_route_is_501_before_handler() -> None:
    hooks = RecordingHooks()
    async with sim(hooks, disabled_routes=(RESPONSES,)) as client:
        refused = await post(client, RESPONSES, body_for(RESPONSES, kv_transfer_params=REMOTE))
        served = await post(client, CHAT, body_for(CHAT))
        entries = await log(client)
    assert refused.status_code == 501
    assert refused.json()["error"] == {
        "message": "The model does not support Responses API",
        "type": "NotImplementedError",
        "param": None,
        "code": 501,
    }
    assert served.status_code == 200
    assert entries[0]["origin"] == "pre_handler"
    assert hooks.calls == []


# --- handler rejections ---------------------------------------------------------------------


async def test_unknown_model_is_404_in_handler_and_notifies() -> None:
    hooks = RecordingHooks()
    async with sim(hooks) as client:
        body = {**body_for(CHAT), "model": "other", "kv_transfer_params": REMOTE}
        response = await post(client, CHAT, body)
        entries = await log(client)
    assert response.status_code == 404
    assert response.json()["error"] == {
        "message": "The model `other` does not exist. Valid aliases: sim-model.",
        "type": "NotFoundError",
        "param": "model",
        "code": 404,
    }
    assert entries[0]["origin"] == "handler"
    assert hooks.calls == [("rejected", "r1", CHAT, REMOTE, 404)]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("route", [CHAT, COMPLETIONS, RESPONSES])
async def test_prompt_over_max_model_len_is_400_in_handler(route: str, stream: bool) -> None:
    # Length checks run while rendering, before the handler returns: JSON even for streams.
    hooks = RecordingHooks()
    # /v1/completions' default max_tokens (16) is over this max_model_len: ask for one token.
    budget = {"max_tokens": 1} if route == COMPLETIONS else {}
    async with sim(hooks, max_model_len=10) as client:
        fits = body_for(route, "w " * 9, kv_transfer_params=REMOTE, stream=stream, **budget)
        ok = await post(client, route, fits, rid="ok")
        response = await post(
            client, route, body_for(route, "w " * 11, kv_transfer_params=REMOTE, stream=stream, **budget)
        )
    assert ok.status_code == 200
    assert response.status_code == 400
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert (error["type"], error["param"]) == ("BadRequestError", "input_tokens")
    assert error["message"].startswith(
        "This model's maximum context length is 10 tokens. However, your prompt contains 11 input tokens"
    )
    assert hooks.calls == [("admitted", "ok", route, REMOTE), ("rejected", "r1", route, REMOTE, 400)]


@pytest.mark.parametrize(
    ("extra", "param", "message"),
    [
        ({"max_tokens": -1}, "max_tokens", "max_tokens must be at least 1, got -1."),
        ({"max_tokens": 0}, "max_tokens", "max_tokens must be at least 1, got 0."),
        ({"max_tokens": 50}, "max_tokens", "max_tokens=50 cannot be greater than max_model_len=20."),
        (
            {"max_completion_tokens": 21},
            "max_completion_tokens",
            "max_completion_tokens=21 cannot be greater",
        ),
    ],
)
async def test_output_budget_errors_are_handler_400s(extra: dict[str, Any], param: str, message: str) -> None:
    async with sim(max_model_len=20) as client:
        response = await post(client, CHAT, body_for(CHAT, **extra))
        entries = await log(client)
    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["type"], error["param"]) == ("BadRequestError", param)
    assert error["message"].startswith(message)
    assert entries[0]["origin"] == "handler"


@pytest.mark.parametrize(
    ("extra", "param", "message"),
    [
        ({"temperature": -1}, "temperature", "temperature must be non-negative, got -1.0."),
        ({"top_p": 0}, "top_p", "top_p must be in (0, 1], got 0.0."),
        ({"top_p": 1.5}, "top_p", "top_p must be in (0, 1], got 1.5."),
    ],
)
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("route", [CHAT, COMPLETIONS, RESPONSES])
async def test_sampling_parameters_out_of_range_are_handler_400s_that_notify(
    route: str, stream: bool, extra: dict[str, Any], param: str, message: str
) -> None:
    # vLLM's SamplingParams checks run in the handler, before it returns a stream: JSON for streams.
    hooks = RecordingHooks()
    async with sim(hooks) as client:
        response = await post(
            client, route, body_for(route, stream=stream, kv_transfer_params=REMOTE, **extra)
        )
        entries = await log(client)
    assert response.status_code == 400
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert (error["type"], error["param"]) == ("BadRequestError", param)
    assert error["message"].startswith(message)
    assert entries[0]["origin"] == "handler"
    assert hooks.calls == [("rejected", "r1", route, REMOTE, 400)]


@pytest.mark.parametrize(("rank", "admitted"), [("0", True), ("1", False), ("5", False), ("x", True)])
async def test_a_data_parallel_rank_out_of_range_is_a_handler_400(rank: str, admitted: bool) -> None:
    hooks = RecordingHooks()
    async with sim(hooks) as client:
        body = body_for(COMPLETIONS, kv_transfer_params=REMOTE)
        response = await post(client, COMPLETIONS, body, headers={"x-data-parallel-rank": rank})
    if admitted:  # in range, or not an integer (vLLM ignores it)
        assert response.status_code == 200
        assert hooks.calls == [("admitted", "r1", COMPLETIONS, REMOTE)]
        return
    assert response.status_code == 400
    assert response.json()["error"] == {
        "message": f"data_parallel_rank {rank} is out of range [0, 1).",
        "type": "BadRequestError",
        "param": None,
        "code": 400,
    }
    assert hooks.calls == [("rejected", "r1", COMPLETIONS, REMOTE, 400)]


async def test_a_data_parallel_rank_out_of_range_in_a_stream_is_200_then_an_error_event() -> None:
    # The engine client refuses it after the handler returned the stream: D's fix does not fire.
    hooks = RecordingHooks()
    async with sim(hooks) as client:
        body = body_for(COMPLETIONS, stream=True, kv_transfer_params=REMOTE)
        response = await post(client, COMPLETIONS, body, headers={"x-data-parallel-rank": "5"})
        entries = await log(client)
    assert response.status_code == 200
    chunks = data_events(response.text)
    assert chunks[1] == "[DONE]"
    assert json.loads(chunks[0])["error"] == {
        "message": "data_parallel_rank 5 is out of range [0, 1).",
        "type": "BadRequestError",
        "param": None,
        "code": 400,
    }
    assert (entries[0]["outcome"], entries[0]["origin"]) == ("stream_error", "stream")
    assert hooks.calls == []


@pytest.mark.parametrize(
    ("status", "type_"),
    [
        (503, "ServiceUnavailableError"),
        (501, "NotImplementedError"),
        (500, "InternalServerError"),
        (422, "UnprocessableEntityError"),
        (404, "NotFoundError"),
        (400, "BadRequestError"),
        (418, "BadRequestError"),
    ],
)
async def test_reject_marker_answers_status_with_vllm_type(status: int, type_: str) -> None:
    hooks = RecordingHooks()
    async with sim(hooks) as client:
        body = body_for(COMPLETIONS, f"hi [[reject:{status}]]", kv_transfer_params=REMOTE, stream=True)
        response = await post(client, COMPLETIONS, body)
        entries = await log(client)
    assert response.status_code == status
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert (error["type"], error["code"], error["param"]) == (type_, status, None)
    assert (entries[0]["outcome"], entries[0]["origin"], entries[0]["status"]) == (
        "rejected",
        "handler",
        status,
    )
    assert hooks.calls == [("rejected", "r1", COMPLETIONS, REMOTE, status)]


@pytest.mark.parametrize("params", [None, {"do_remote_prefill": False}, {"remote_request_id": "x"}])
async def test_hooks_only_for_remote_prefill_requests(params: dict[str, Any] | None) -> None:
    hooks = RecordingHooks()
    async with sim(hooks) as client:
        await post(client, CHAT, body_for(CHAT, kv_transfer_params=params))
        await post(client, CHAT, body_for(CHAT, "[[reject:503]]", kv_transfer_params=params))
    assert hooks.calls == []


async def test_failing_hooks_do_not_change_answers() -> None:
    hooks = RecordingHooks(fail=True)
    async with sim(hooks) as client:
        admitted = await post(client, CHAT, body_for(CHAT, kv_transfer_params=REMOTE))
        rejected = await post(client, CHAT, body_for(CHAT, "[[reject:500]]", kv_transfer_params=REMOTE))
    assert (admitted.status_code, rejected.status_code) == (200, 500)
    assert [call[0] for call in hooks.calls] == ["admitted", "rejected"]


# --- in-band stream errors and drops --------------------------------------------------------


@pytest.mark.parametrize("route", [CHAT, COMPLETIONS])
async def test_stream_error_marker_is_200_then_error_event(route: str) -> None:
    hooks = RecordingHooks()
    async with sim(hooks) as client:
        body = body_for(route, "[[stream-error:400]]", stream=True, kv_transfer_params=REMOTE)
        response = await post(client, route, body)
        entries = await log(client)
    assert response.status_code == 200
    chunks = data_events(response.text)
    assert len(chunks) == 2 and chunks[1] == "[DONE]"
    error = json.loads(chunks[0])["error"]
    assert (error["type"], error["param"], error["code"]) == ("BadRequestError", None, 400)
    assert (entries[0]["outcome"], entries[0]["origin"], entries[0]["admitted"]) == (
        "stream_error",
        "stream",
        False,
    )
    assert hooks.calls == []  # vLLM's cleanup saw a generator, D never admitted it


async def test_stream_error_marker_without_stream_is_a_handler_rejection() -> None:
    hooks = RecordingHooks()
    async with sim(hooks) as client:
        response = await post(client, CHAT, body_for(CHAT, "[[stream-error:503]]", kv_transfer_params=REMOTE))
    assert response.status_code == 503
    assert hooks.calls == [("rejected", "r1", CHAT, REMOTE, 503)]


async def test_responses_stream_error_cuts_the_connection() -> None:
    async with sim() as client:
        with pytest.raises(SimulatedDrop):
            await post(client, RESPONSES, body_for(RESPONSES, "[[stream-error:400]]", stream=True))
        entries = await log(client)
    assert entries[0]["outcome"] == "stream_error"


@pytest.mark.parametrize(("stream", "knobs"), [(True, {}), (False, {}), (True, {"drop_mid_stream": True})])
async def test_drop_mid_stream_aborts_after_admission(stream: bool, knobs: dict[str, Any]) -> None:
    hooks = RecordingHooks()
    text = "hello" if knobs else "hello [[drop-mid-stream]]"
    async with sim(hooks, **knobs) as client:
        with pytest.raises(SimulatedDrop):
            await post(client, CHAT, body_for(CHAT, text, stream=stream, kv_transfer_params=REMOTE))
        entries = await log(client)
    assert (entries[0]["outcome"], entries[0]["admitted"], entries[0]["status"]) == ("dropped", True, 200)
    assert hooks.calls == [("admitted", "r1", CHAT, REMOTE)]


async def test_drop_mid_stream_knob_leaves_non_stream_answers_alone() -> None:
    async with sim(drop_mid_stream=True) as client:
        response = await post(client, CHAT, body_for(CHAT))
    assert response.status_code == 200 and response.json()["choices"]


# --- waits, hangs, overload ---------------------------------------------------------------


@pytest.mark.parametrize(("knobs", "text"), [({"latency": 0.2}, "hi"), ({}, "hi [[slow-headers:0.2]]")])
async def test_latency_and_slow_headers_delay_the_answer(knobs: dict[str, Any], text: str) -> None:
    async with sim(**knobs) as client:
        started = time.monotonic()
        response = await post(client, CHAT, body_for(CHAT, text))
    assert response.status_code == 200
    assert time.monotonic() - started >= 0.2


@pytest.mark.parametrize(("knobs", "text"), [({"hang": True}, "hi"), ({}, "hi [[hang]]")])
async def test_hang_until_client_leaves_counts_as_handler_cancel(knobs: dict[str, Any], text: str) -> None:
    hooks = RecordingHooks()
    async with sim(hooks, **knobs) as client:
        request = asyncio.ensure_future(post(client, CHAT, body_for(CHAT, text, kv_transfer_params=REMOTE)))
        entries = await logged(client)
        assert entries[0]["outcome"] == "pending" and not request.done()
        request.cancel()
        with pytest.raises(asyncio.CancelledError):
            await request
        entries = await log(client)
    assert (entries[0]["outcome"], entries[0]["status"], entries[0]["origin"]) == (
        "cancelled",
        499,
        "handler",
    )
    assert hooks.calls == [("rejected", "r1", CHAT, REMOTE, 499)]


async def test_max_concurrency_rejects_above_limit_with_503() -> None:
    hooks = RecordingHooks()
    async with sim(hooks, max_concurrency=1) as client:
        held = asyncio.ensure_future(post(client, CHAT, body_for(CHAT, "[[hang]]"), rid="held"))
        await logged(client)
        refused = await post(client, CHAT, body_for(CHAT, kv_transfer_params=REMOTE), rid="refused")
        held.cancel()
        with pytest.raises(asyncio.CancelledError):
            await held
        after = await post(client, CHAT, body_for(CHAT), rid="after")
    assert refused.status_code == 503
    error = refused.json()["error"]
    assert (error["type"], error["code"]) == ("Service Unavailable", 503)
    assert error["message"].startswith("The engine is currently busy")
    assert ("rejected", "refused", CHAT, REMOTE, 503) in hooks.calls
    assert after.status_code == 200


SCALING = {"error": "The model is currently scaling. Please try again later."}
HANDLER_503 = "ServiceUnavailableError"


@pytest.mark.parametrize(("origin", "notified"), [("pre_handler", False), ("handler", True)])
async def test_fail_first_then_success_and_reset(origin: str, notified: bool) -> None:
    hooks = RecordingHooks()
    async with sim(hooks, fail_first=2, fail_origin=origin) as client:
        statuses = [
            (await post(client, CHAT, body_for(CHAT, kv_transfer_params=REMOTE))).status_code
            for _ in range(3)
        ]
        first = await post(client, COMPLETIONS, body_for(COMPLETIONS))
        entries = await log(client)
        assert (await client.post("/sim/reset")).status_code == 204
        assert await log(client) == []
        again = await post(client, COMPLETIONS, body_for(COMPLETIONS))
    assert statuses == [503, 503, 200] and first.status_code == 200
    assert [entry["origin"] for entry in entries[:2]] == [origin, origin]
    assert again.status_code == 503
    # Before the handler vLLM's only 503 is elastic-EP scaling's untyped body; "ServiceUnavailableError"
    # is a handler's (a retryable error the engine sent back), which D's own cleanup sees.
    if origin == "pre_handler":
        assert again.json() == SCALING
    else:
        assert again.json()["error"]["type"] == HANDLER_503
    rejected = [call for call in hooks.calls if call[0] == "rejected"]
    assert len(rejected) == (2 if notified else 0)


@pytest.mark.parametrize(
    ("status", "body"),
    [
        (401, {"error": "Unauthorized"}),  # the API-key middleware
        (503, SCALING),  # the elastic-EP scaling middleware
        (400, {"type": "Bad Request", "code": 400}),  # an HTTPException: typed with the phrase
        (429, {"type": "Too Many Requests", "code": 429}),
        (500, {"type": "Internal Server Error", "code": 500}),
    ],
)
async def test_a_pre_handler_failure_is_answered_as_vllm_answers_before_its_handler(
    status: int, body: dict[str, object]
) -> None:
    async with sim(fail_first=1, fail_status=status, fail_origin="pre_handler") as client:
        answer = await post(client, CHAT, body_for(CHAT, kv_transfer_params=REMOTE))
    assert answer.status_code == status
    found = answer.json()
    if "error" in body and isinstance(body["error"], str):
        assert found == body
    else:
        assert {key: found["error"][key] for key in body} == body
        assert found["error"]["type"] not in HANDLER_ERROR_TYPES.values()


async def test_log_is_bounded() -> None:
    async with sim(log_size=2) as client:
        for rid in ("a", "b", "c"):
            await post(client, CHAT, body_for(CHAT), rid=rid)
        entries = await log(client)
    assert [entry["request_id"] for entry in entries] == ["b", "c"]


# --- other endpoints ------------------------------------------------------------------------


async def test_info_endpoints() -> None:
    async with sim(version="0.21.0", model="m", max_model_len=99) as client:
        await post(client, CHAT, {"messages": [], "model": "m"})
        health = await client.get("/health")
        version = await client.get("/version")
        models = await client.get("/v1/models")
        metrics = await client.get("/metrics")
        tokens = await client.post("/tokenize", json={"prompt": "a b c"})
        chat_tokens = await client.post("/tokenize", json={"messages": [{"role": "user", "content": "x y"}]})
        bad_tokens = await client.post("/tokenize", json={"prompt": 3})
    assert (health.status_code, health.content) == (200, b"")
    assert version.json() == {"version": "0.21.0"}
    listed = models.json()
    assert listed["object"] == "list" and [m["id"] for m in listed["data"]] == ["m"]
    assert listed["data"][0]["max_model_len"] == 99
    assert 'sim_decode_requests_total{outcome="admitted"} 1.0' in metrics.text
    assert 'vllm:num_requests_running{model_name="m"} 0.0' in metrics.text
    assert tokens.json() == {"count": 3, "max_model_len": 99, "tokens": [0, 1, 2], "token_strs": None}
    assert chat_tokens.json()["count"] == 2
    assert bad_tokens.status_code == 400


async def test_unknown_path_and_wrong_method_answer_like_fastapi() -> None:
    async with sim() as client:
        missing = await client.post("/v1/embeddings", json={})
        wrong = await client.get(CHAT, headers={"x-request-id": "q"})
        entries = await log(client)
    assert (missing.status_code, missing.json()) == (404, {"detail": "Not Found"})
    assert (wrong.status_code, wrong.json()) == (405, {"detail": "Method Not Allowed"})
    assert wrong.headers["x-request-id"] == "q"
    assert entries == []


# --- config ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("knobs", "field"),
    [
        ({"port": 70000}, "port"),
        ({"stream_events": 0}, "stream_events"),
        ({"max_model_len": 0}, "max_model_len"),
        ({"event_delay": -1.0}, "event_delay"),
        ({"fail_status": 200}, "fail_status"),
        ({"max_concurrency": -1}, "max_concurrency"),
        ({"model": ""}, "model"),
        ({"disabled_routes": ("/v1/embeddings",)}, "disabled_routes"),
    ],
)
def test_config_rejects_bad_values(knobs: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError) as caught:
        DecodeSimConfig(**knobs)
    assert caught.value.field == field


def test_flags_mirror_config() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(
        [
            "--stream-events",
            "64",
            "--event-delay",
            "0.5",
            "--hang",
            "--disabled-route",
            CHAT,
            "--api-key",
            "k",
        ]
    )
    config = config_from_args(args)
    assert config == DecodeSimConfig(
        stream_events=64, event_delay=0.5, hang=True, disabled_routes=(CHAT,), api_key="k"
    )
    assert config_from_args(parser.parse_args([])) == DecodeSimConfig()


def test_cli_dispatches_sim_decode() -> None:
    args = build_parser("sim-decode").parse_args(["sim-decode", "--port", "0", "--fail-first", "3"])
    assert config_from_args(args) == DecodeSimConfig(port=0, fail_first=3)


def test_cli_exits_2_on_bad_value_before_serving(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sim-decode", "--stream-events", "0"]) == 2
    assert "stream_events" in capsys.readouterr().err


async def test_a_responses_prompt_of_exactly_max_model_len_is_the_handlers_invalid_request_error() -> None:
    hooks = RecordingHooks()
    async with sim(hooks, max_model_len=10) as client:
        response = await post(client, RESPONSES, body_for(RESPONSES, "w " * 10, kv_transfer_params=REMOTE))
    error = response.json()["error"]
    assert (response.status_code, error["type"], error["param"]) == (400, "invalid_request_error", "input")
    assert error["message"].startswith("The engine prompt length 10 exceeds the max_model_len 10.")
    assert hooks.calls == [("rejected", "r1", RESPONSES, REMOTE, 400)]  # in the handler: D's fix sees it
