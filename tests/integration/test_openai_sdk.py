"""The official OpenAI Python SDK against sim-decode, directly and through the sidecar.

A real cluster on loopback: sim-prefill (real NIXL agents), sim-decode in
"vLLM D" mode and a sidecar with the NIXL strategy (and injection by
header), each on its defaults for the model name. Every completion route,
streamed and not, the ``responses.stream()`` helper (which needs the item
and content-part events vLLM sends before the first delta), a P/D request
carrying P's ``kv_transfer_params``, and the typed errors a client gets for
D's refusals and the sidecar's own answers.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from sidecar.sim.decode import DecodeSimConfig, create_decode_app
from sidecar.sim.decode.nixl import VllmDHooks
from sidecar.sim.prefill import PrefillSimConfig, create_prefill_app
from sidecar.sim.servers import ServerThread, serve
from tests.support.runner import Sidecar, run_sidecar

pytestmark = pytest.mark.nixl

MODEL = "sim-model"  # both simulators' default
ANSWER = "t0 t1 t2 t3 t4 t5 t6 t7"  # sim-decode's default answer: 8 tokens


@pytest.fixture(scope="module")
def cluster() -> Iterator[tuple[ServerThread, ServerThread, Sidecar]]:
    p_config = PrefillSimConfig(port=0, side_channel_port=0, num_blocks=256, lease=0, log_level="error")
    with (
        serve(create_prefill_app(p_config)) as p,
        serve(create_decode_app(DecodeSimConfig(port=0), VllmDHooks("0.33.0"))) as d,
        run_sidecar(d.url, release="nixl", prefill_allow=("127.0.0.1",), inject_header=True) as sc,
    ):
        yield p, d, sc


@pytest.fixture(params=["direct", "sidecar"])
def client(
    request: pytest.FixtureRequest, cluster: tuple[ServerThread, ServerThread, Sidecar]
) -> Iterator[openai.OpenAI]:
    _, d, sc = cluster
    url = d.url if request.param == "direct" else sc.url
    with openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=10) as sdk:
        yield sdk


@pytest.mark.parametrize("stream", [False, True])
def test_chat_completions(client: openai.OpenAI, stream: bool) -> None:
    messages: Any = [{"role": "user", "content": "hello there"}]
    if not stream:
        answer = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3)
        choice = answer.choices[0]
        assert (choice.message.content, choice.finish_reason) == ("t0 t1 t2", "length")
        assert answer.usage is not None and answer.usage.completion_tokens == 3
        return
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ANSWER and chunks[-1].choices[0].finish_reason == "stop"


@pytest.mark.parametrize("stream", [False, True])
def test_completions(client: openai.OpenAI, stream: bool) -> None:
    if not stream:
        answer = client.completions.create(model=MODEL, prompt="hello there")
        assert (answer.choices[0].text, answer.choices[0].finish_reason) == (ANSWER, "stop")
        return
    chunks = list(client.completions.create(model=MODEL, prompt="hello", max_tokens=5, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == "t0 t1 t2 t3 t4"
    assert chunks[-1].choices[0].finish_reason == "length"


def test_responses(client: openai.OpenAI) -> None:
    answer = client.responses.create(model=MODEL, input="hello there")
    assert (answer.output_text, answer.status) == (ANSWER, "completed")
    assert answer.usage is not None and answer.usage.output_tokens == 8
    cut = client.responses.create(model=MODEL, input="hello", max_output_tokens=2)
    assert (cut.output_text, cut.status) == ("t0 t1", "incomplete")


def test_responses_streamed(client: openai.OpenAI) -> None:
    events = list(client.responses.create(model=MODEL, input="hello there", stream=True))
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    deltas = [event.delta for event in events if event.type == "response.output_text.delta"]
    assert "".join(deltas) == ANSWER


def test_responses_stream_helper(client: openai.OpenAI) -> None:
    with client.responses.stream(model=MODEL, input="hello there") as stream:
        seen = [event.type for event in stream]
        final = stream.get_final_response()
    assert "response.output_item.added" in seen and "response.content_part.added" in seen
    assert final.output_text == ANSWER and final.status == "completed"


def test_a_pd_request_with_p_parameters(cluster: tuple[ServerThread, ServerThread, Sidecar]) -> None:
    p, _, sc = cluster
    params = prefill(p, "sdk-pd")
    with openai.OpenAI(base_url=sc.url + "/v1", api_key="unused", max_retries=0, timeout=10) as sdk:
        answer = sdk.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "w " * 20}],
            extra_body={"kv_transfer_params": params},
            extra_headers={"x-request-id": "sdk-pd"},
        )
    assert answer.choices[0].message.content == ANSWER
    assert answer.usage is not None and answer.usage.prompt_tokens == 20


@pytest.mark.parametrize(
    ("error", "body", "vllm_type"),
    [
        (openai.BadRequestError, {"temperature": "hot"}, "Bad Request"),
        (openai.NotFoundError, {"model": "nope"}, "NotFoundError"),
        (openai.UnprocessableEntityError, {"prompt": "x [[reject:422]]"}, "UnprocessableEntityError"),
        (openai.InternalServerError, {"prompt": "x [[reject:500]]"}, "InternalServerError"),
    ],
)
def test_d_refusals_are_typed_errors(
    client: openai.OpenAI, error: type[openai.APIStatusError], body: dict[str, Any], vllm_type: str
) -> None:
    settings: dict[str, Any] = {"model": MODEL, "prompt": "hello", **body}
    with pytest.raises(error) as raised:
        client.completions.create(**settings)
    assert raised.value.type == vllm_type


def test_the_sidecars_own_answers_are_typed_errors(
    cluster: tuple[ServerThread, ServerThread, Sidecar],
) -> None:
    p, _, sc = cluster
    with openai.OpenAI(base_url=sc.url + "/v1", api_key="unused", max_retries=0, timeout=10) as sdk:
        with pytest.raises(openai.UnprocessableEntityError) as injected:
            sdk.completions.create(model=MODEL, prompt="hi", extra_headers={"x-kvr-inject-reject": "422"})
        assert injected.value.type == "UnprocessableEntityError"
        params = prefill(p, "sdk-replay")
        refused: dict[str, Any] = {
            "model": MODEL,
            "prompt": "hi",
            "extra_body": {"kv_transfer_params": params},
        }
        with pytest.raises(openai.BadRequestError):  # D refuses it; the sidecar releases P's blocks
            sdk.completions.create(**refused, temperature="hot")  # type: ignore[arg-type]
        sc.settle()
        with pytest.raises(openai.ConflictError) as replay:  # the same parameters again
            sdk.completions.create(**refused)
    assert replay.value.type == "ConflictError" and replay.value.param == "kv_transfer_params"


def prefill(p: ServerThread, request_id: str) -> dict[str, Any]:
    """The prefill leg on P: it pins the prompt's blocks and answers kv_transfer_params."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "w " * 20}],
        "max_tokens": 1,
        "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False},
    }
    answer = httpx.post(p.url + "/v1/chat/completions", json=body, headers={"x-request-id": request_id})
    assert answer.status_code == 200, answer.text
    params: dict[str, Any] = answer.json()["kv_transfer_params"]
    return params
