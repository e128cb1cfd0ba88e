"""The decode simulator reads request fields as vLLM's pydantic models do, honours the output
budget, and keeps a bounded log.

The field rules are checked against pydantic itself: models with the field
types vLLM 0.33.0's request models declare for the fields the simulator
reads, validated from the same JSON, must accept the same values (converted
alike) and refuse the rest with the same error type, location and message.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pydantic
import pytest

from sidecar.sim.decode import DecodeSimConfig, create_decode_app
from sidecar.sim.decode.fields import CHAT, COMPLETIONS, RESPONSES, check_fields


class StreamOptions(pydantic.BaseModel):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class ChatFields(pydantic.BaseModel):  # vLLM 0.33.0 ChatCompletionRequest, the fields read
    model: str | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    kv_transfer_params: dict[str, Any] | None = None


class CompletionFields(pydantic.BaseModel):  # CompletionRequest
    model: str | None = None
    max_tokens: int | None = 16
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    kv_transfer_params: dict[str, Any] | None = None


class ResponsesFields(pydantic.BaseModel):  # ResponsesRequest
    max_output_tokens: int | None = None
    model: str | None = None
    stream: bool | None = False
    temperature: float | None = None
    top_p: float | None = None
    kv_transfer_params: dict[str, Any] | None = None


MODELS: dict[str, type[pydantic.BaseModel]] = {
    CHAT: ChatFields,
    COMPLETIONS: CompletionFields,
    RESPONSES: ResponsesFields,
}
BODIES = [
    {"temperature": "hot"},
    {"temperature": "0.5", "top_p": 1},
    {"temperature": True, "top_p": [1]},
    {"temperature": {}, "top_p": " 0.25 "},
    {"max_tokens": "5", "max_completion_tokens": 5.0, "max_output_tokens": "7"},
    {"max_tokens": 5.5, "max_completion_tokens": "x", "max_output_tokens": [1]},
    {"max_tokens": True, "max_output_tokens": 1e20},
    {"max_tokens": " 12 ", "max_output_tokens": "1_000"},
    {"model": 5, "stream": "yes"},
    {"model": "m", "stream": "maybe"},
    {"stream": 2, "kv_transfer_params": [1]},
    {"stream": [], "kv_transfer_params": {"a": 1}},
    {"stream_options": "include_usage"},
    {"stream_options": {"include_usage": "maybe"}},
    {"stream_options": {"include_usage": "on", "continuous_usage_stats": 0}},
    {"temperature": None, "max_tokens": None, "stream": None},
]


@pytest.mark.parametrize("route", [CHAT, COMPLETIONS, RESPONSES])
@pytest.mark.parametrize("body", BODIES, ids=[json.dumps(body) for body in BODIES])
def test_fields_are_read_as_pydantic_reads_them(route: str, body: dict[str, Any]) -> None:
    model = MODELS[route]
    values, errors = check_fields(route, body)
    try:
        parsed = model.model_validate_json(json.dumps(body))
    except pydantic.ValidationError as exc:
        expected = [
            (e["type"], ".".join(("body", *map(str, e["loc"]))), e["msg"])
            for e in exc.errors(include_url=False)
        ]
        assert [(e.type, e.loc, e.msg) for e in errors] == expected
        return
    assert errors == []
    given = {name for name, value in body.items() if value is not None and name in model.model_fields}
    dumped = parsed.model_dump(include=given)
    assert {name: values[name] for name in given} == dumped


def sim_client(**knobs: Any) -> httpx.AsyncClient:
    app = create_decode_app(DecodeSimConfig(**knobs))
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://d")


async def test_a_wrong_type_is_vllms_400_naming_every_error() -> None:
    async with sim_client() as client:
        body = {"model": "sim-model", "prompt": "hi", "temperature": "hot", "max_tokens": "many"}
        response = await client.post(COMPLETIONS, json=body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["type"], error["param"], error["code"]) == ("Bad Request", "body.max_tokens", 400)
    assert error["message"] == (
        "2 validation errors:\n"
        "  {'type': 'int_parsing', 'loc': 'body.max_tokens', 'msg': 'Input should be a valid integer, "
        "unable to parse string as an integer', 'input': 'many'}\n"
        "  {'type': 'float_parsing', 'loc': 'body.temperature', 'msg': 'Input should be a valid number, "
        "unable to parse string as a number', 'input': 'hot'}"
    )


@pytest.mark.parametrize(
    ("route", "budget", "tokens"),
    [
        (CHAT, {"max_tokens": 3}, 3),
        (CHAT, {"max_tokens": 30, "max_completion_tokens": "2"}, 2),
        (COMPLETIONS, {"max_tokens": 5}, 5),
        (COMPLETIONS, {}, 8),  # vLLM's default for completions is 16: the whole answer fits
        (RESPONSES, {"max_output_tokens": 4}, 4),
        (CHAT, {"max_tokens": 20}, 8),
    ],
)
@pytest.mark.parametrize("stream", [False, True])
async def test_the_output_budget_cuts_the_answer(
    route: str, budget: dict[str, Any], tokens: int, stream: bool
) -> None:
    field = {CHAT: "messages", COMPLETIONS: "prompt", RESPONSES: "input"}[route]
    prompt: Any = [{"role": "user", "content": "a b"}] if route == CHAT else "a b"
    body = {"model": "sim-model", field: prompt, "stream": stream, **budget}
    async with sim_client(stream_events=8) as client:
        response = await client.post(route, json=body)
    assert response.status_code == 200
    text, finish = _text_and_finish(route, response.text, stream)
    assert text.split() == [f"t{i}" for i in range(tokens)]
    assert finish == ("length" if tokens < 8 else "stop")


def _text_and_finish(route: str, raw: str, stream: bool) -> tuple[str, str]:
    if not stream:
        answer = json.loads(raw)
        if route == RESPONSES:
            status = answer["status"]
            return answer["output"][0]["content"][0]["text"], "length" if status == "incomplete" else "stop"
        choice = answer["choices"][0]
        return choice.get("text") or choice["message"]["content"], choice["finish_reason"]
    events = [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: {")]
    if route == RESPONSES:
        terminal = events[-1]
        assert terminal["type"] in ("response.completed", "response.incomplete")
        text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
        return text, "length" if terminal["type"] == "response.incomplete" else "stop"
    texts = [c.get("text") or c["delta"].get("content", "") for e in events for c in e["choices"]]
    return "".join(texts), next(
        c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]
    )


async def test_the_log_is_bounded_and_keeps_parameters_only_when_asked() -> None:
    params = {"do_remote_prefill": True, "remote_block_ids": [list(range(1000))]}
    body = {"model": "sim-model", "prompt": "hi", "kv_transfer_params": params}
    async with sim_client(log_size=3) as client:
        for index in range(5):
            await client.post(COMPLETIONS, json=body, headers={"x-request-id": f"r{index}"})
        entries = (await client.get("/sim/log")).json()
    assert [entry["request_id"] for entry in entries] == ["r2", "r3", "r4"]
    assert all(entry["kv_transfer_params"] is None and entry["admitted"] for entry in entries)
    async with sim_client(log_params=True) as client:
        await client.post(COMPLETIONS, json=body)
        entries = (await client.get("/sim/log")).json()
    assert entries[0]["kv_transfer_params"] == params
