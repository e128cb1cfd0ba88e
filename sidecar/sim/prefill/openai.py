"""The OpenAI-facing half of the simulated P: request view, ids, response bodies.

Token counts are whitespace-split words (a list of ints counts its length);
the answer is a one-token completion shaped like vLLM's, carrying the
``kv_transfer_params`` P's NIXL scheduler emits in the chosen release
(P scheduler's ``request_finished``). Internal request ids follow vLLM's OpenAI server:
``cmpl-<x-request-id>-<prompt index>`` / ``chatcmpl-<x-request-id>``, plus a
random ``-<8 hex>`` suffix from 0.14.0. Error bodies are vLLM's,
nested from 0.10.1 and flat before. ``stream`` is ignored: the
prefill leg of a P/D request is answered as one JSON body.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

import msgspec

from sidecar.sim.prefill.release import Release

Route = Literal["completions", "chat"]
_ENCODER = msgspec.json.Encoder()


class CompletionRequest(msgspec.Struct):
    """The fields of a /v1/completions or /v1/chat/completions body the simulator reads."""

    model: Any = None
    prompt: Any = None
    messages: Any = None
    kv_transfer_params: Any = None


REQUEST_DECODER = msgspec.json.Decoder(CompletionRequest)


class BadRequest(ValueError):
    """A body vLLM would answer with 400."""


def count_tokens(route: Route, body: CompletionRequest) -> int:
    """Prompt tokens: words of the prompt / message texts, or the length of a token list."""
    if route == "chat":
        if not isinstance(body.messages, list):
            raise BadRequest("messages must be a list")
        return sum(_message_tokens(message) for message in body.messages)
    prompt = body.prompt
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return len(prompt.split())
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return len(prompt)
    raise BadRequest("prompt must be a string or a list of token ids (batches are not simulated)")


def _message_tokens(message: Any) -> int:
    content = message.get("content") if isinstance(message, dict) else None
    if isinstance(content, str):
        return len(content.split())
    if isinstance(content, list):
        texts = [part.get("text", "") for part in content if isinstance(part, dict)]
        return sum(len(text.split()) for text in texts if isinstance(text, str))
    return 0


def wants_remote_decode(body: CompletionRequest) -> bool:
    """True for a P/D prefill leg: ``kv_transfer_params.do_remote_decode`` is true."""
    params = body.kv_transfer_params
    return isinstance(params, dict) and params.get("do_remote_decode") is True


def request_ids(release: Release, route: Route, x_request_id: str | None) -> tuple[str, str]:
    """(response id, P's internal engine request id) for one request."""
    base = x_request_id or uuid.uuid4().hex
    if route == "chat":
        response_id = internal = f"chatcmpl-{base}"
    else:
        response_id, internal = f"cmpl-{base}", f"cmpl-{base}-0"
    if release.random_id_suffix:
        internal = f"{internal}-{uuid.uuid4().hex[:8]}"
    return response_id, internal


def emitted_blocks(release: Release, blocks: list[int], tokens: int, block_size: int) -> list[int]:
    """The block ids P reports: 0.9.0-0.10.0 leave out a trailing partial block."""
    if release.drops_partial_block and tokens % block_size:
        return blocks[:-1]
    return blocks


def kv_transfer_params(
    release: Release,
    *,
    blocks: list[int],
    engine_id: str,
    internal_id: str,
    host: str,
    port: int,
    tp: int,
    pp: int,
    tokens: int,
    generation: int,
) -> dict[str, Any]:
    """``kv_transfer_params`` exactly as ``request_finished`` builds them in ``release``."""
    params: dict[str, Any] = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": [blocks] if release.nested_block_ids else blocks,
        "remote_engine_id": engine_id,
    }
    if release.remote_request_id:
        params["remote_request_id"] = internal_id
    params.update(remote_host=host, remote_port=port)
    optional: list[tuple[bool, str, Any]] = [
        (release.tp_size_param, "tp_size", tp),
        (release.remote_num_tokens, "remote_num_tokens", tokens),
        (release.expiry_time_param, "remote_blocks_expiry_time", None),
        (release.transfer_mode, "transfer_mode", "pull"),
        (release.pp_size_param, "pp_size", pp),
        (release.dcp_size_param, "dcp_size", 1),
        (release.registration_generation, "remote_registration_generation", generation),
    ]
    params.update({name: value for present, name, value in optional if present})
    return params


def completion_body(
    route: Route,
    *,
    response_id: str,
    model: str,
    tokens: int,
    params: dict[str, Any] | None,
) -> bytes:
    """A vLLM-shaped one-token, length-capped completion."""
    usage = {
        "prompt_tokens": tokens,
        "total_tokens": tokens + 1,
        "completion_tokens": 1,
        "prompt_tokens_details": None,
    }
    choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": "length"}
    if route == "chat":
        choice["message"] = {"role": "assistant", "content": "the", "tool_calls": []}
    else:
        choice["text"] = " the"
    choice["stop_reason"] = None
    body = {
        "id": response_id,
        "object": "chat.completion" if route == "chat" else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        "usage": usage,
        "prompt_logprobs": None,
        "kv_transfer_params": params,
    }
    return _ENCODER.encode(body)


def error_body(release: Release, message: str, type_: str, status: int) -> bytes:
    """vLLM's error body; ``code`` equals the HTTP status."""
    info = {"message": message, "type": type_, "param": None, "code": status}
    if release.nested_error_body:
        return _ENCODER.encode({"error": info})
    return _ENCODER.encode({"object": "error", **info})


def models_body(model: str, max_model_len: int) -> bytes:
    """``GET /v1/models`` with the one served model."""
    card = {
        "id": model,
        "object": "model",
        "created": int(time.time()),
        "owned_by": "vllm",
        "root": model,
        "parent": None,
        "max_model_len": max_model_len,
    }
    return _ENCODER.encode({"object": "list", "data": [card]})
