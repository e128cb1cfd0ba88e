"""The OpenAI-facing half of the simulated P: request view, ids, response bodies.

Token counts are whitespace-split words (a list of ints counts its length);
the answer is a one-token completion shaped like vLLM's (chat, completions,
Anthropic's messages, the token-in generate route), carrying the
``kv_transfer_params`` P's NIXL scheduler emits in the chosen release
(P scheduler's ``request_finished``). Internal request ids follow vLLM's OpenAI server:
``cmpl-<x-request-id>-<prompt index>`` / ``chatcmpl-<x-request-id>``, plus a
random ``-<8 hex>`` suffix from 0.14.0. Error bodies are vLLM's,
nested from 0.10.1 and flat before, Anthropic's shape on ``/v1/messages``.
``stream`` is ignored: the prefill leg of a P/D request is answered as one
JSON body. ``SamplingParams``' check of ``min_tokens`` against
``max_tokens`` is made as vLLM 0.33.0 makes it (``sampling_params.py``
``_verify_args``), so a prefill leg that caps one and not the other is
refused as a real P refuses it.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

import msgspec

from sidecar.sim.prefill.release import Release

Route = Literal["completions", "chat", "messages", "generate"]
_ENCODER = msgspec.json.Encoder()


class CompletionRequest(msgspec.Struct):
    """The fields of a /v1/completions or /v1/chat/completions body the simulator reads."""

    model: Any = None
    prompt: Any = None
    messages: Any = None
    token_ids: Any = None  # /inference/v1/generate
    max_tokens: Any = None
    max_completion_tokens: Any = None
    min_tokens: Any = None
    sampling_params: Any = None  # /inference/v1/generate
    kv_transfer_params: Any = None


REQUEST_DECODER = msgspec.json.Decoder(CompletionRequest)


class BadRequest(ValueError):
    """A body vLLM would answer with 400."""


def count_tokens(route: Route, body: CompletionRequest) -> int:
    """Prompt tokens: words of the prompt / message texts, or the length of a token list."""
    if route == "generate":
        ids = body.token_ids
        if not isinstance(ids, list) or not ids or not all(isinstance(t, int) for t in ids):
            raise BadRequest("token_ids must be a non-empty list of token ids")
        return len(ids)
    if route in ("chat", "messages"):
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


COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # CompletionRequest's and SamplingParams' default


def check_sampling(route: Route, body: CompletionRequest) -> None:
    """``SamplingParams``' ``min_tokens <= max_tokens`` (0.33.0 ``_verify_args``), on the budget
    the route's request model hands it; raises BadRequest with vLLM's message."""
    source: Any = body
    if route == "generate":
        source = body.sampling_params if isinstance(body.sampling_params, dict) else {}
        fields = (source.get("max_tokens", COMPLETIONS_DEFAULT_MAX_TOKENS), source.get("min_tokens"))
    elif route == "chat":
        fields = (
            body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens,
            body.min_tokens,
        )
    elif route == "completions":
        fields = (
            COMPLETIONS_DEFAULT_MAX_TOKENS if body.max_tokens is None else body.max_tokens,
            body.min_tokens,
        )
    else:  # messages: Anthropic's request has no min_tokens
        return
    max_tokens, min_tokens = fields
    if isinstance(max_tokens, int) and isinstance(min_tokens, int) and min_tokens > max_tokens:
        raise BadRequest(
            f"min_tokens must be less than or equal to max_tokens={max_tokens}, got {min_tokens}."
        )


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
    if route in ("chat", "messages"):  # /v1/messages runs vLLM's chat handler
        response_id = internal = f"chatcmpl-{base}"
    elif route == "generate":
        response_id = internal = f"generate-tokens-{base}"
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
    if route == "messages":
        return _ENCODER.encode(_message(response_id, model, tokens, params))
    usage = {
        "prompt_tokens": tokens,
        "total_tokens": tokens + 1,
        "completion_tokens": 1,
        "prompt_tokens_details": None,
    }
    if route == "generate":
        generated = {"index": 0, "finish_reason": "length", "stop_reason": None, "token_ids": [7]}
        body: dict[str, Any] = {
            "request_id": response_id,
            "created": int(time.time()),
            "model": model,
            "choices": [generated],
            "usage": usage,
            "output_mode": "tokens",
            "kv_transfer_params": params,
        }
        return _ENCODER.encode(body)
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


def _message(response_id: str, model: str, tokens: int, params: dict[str, Any] | None) -> dict[str, Any]:
    """vLLM's ``AnthropicMessagesResponse`` (``exclude_none``): the chat answer converted."""
    body: dict[str, Any] = {
        "id": response_id,
        "type": "message",
        "role": "assistant",
        "content": [{"type": "text", "text": "the"}],
        "model": model,
        "stop_reason": "max_tokens",
        "usage": {"input_tokens": tokens, "output_tokens": 1},
    }
    if params is not None:
        body["kv_transfer_params"] = params
    return body


#: vLLM 0.33.0's ``translate_error_type`` (``entrypoints/anthropic/protocol.py``), by status.
ANTHROPIC_ERROR_TYPES = {400: "invalid_request_error", 404: "not_found_error", 503: "overloaded_error"}


def error_body(release: Release, message: str, type_: str, status: int, route: Route = "chat") -> bytes:
    """vLLM's error body; ``code`` equals the HTTP status. A handler's error on ``/v1/messages``
    is translated to Anthropic's shape (no code; the type named by the status)."""
    if route == "messages":
        kind = ANTHROPIC_ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
        return _ENCODER.encode({"type": "error", "error": {"type": kind, "message": message}})
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
