"""Pure rules of the decode simulator: what vLLM would say about one request body.

Decoding and validating a body the way vLLM's pydantic models do (a 400
``"Bad Request"`` before the handler), counting its prompt (one token per
whitespace-separated word), reading the ``[[...]]`` fault markers in the
prompt, the handler's own checks (unknown model, context length, output
budget; the error bodies are ``sidecar.sim.decode.rejections``). Nothing here touches the
network, a clock or shared state, so every rule is tested with a table.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import msgspec

from sidecar.sim.decode.fields import FieldError, check_fields
from sidecar.sim.decode.rejections import (
    HANDLER_ERROR_TYPES,
    Origin,
    Rejection,
    handler_error_type,
    handler_rejection,
    in_model_order,
    json_error,
    pre_handler_rejection,
    rejection_of,
    unsupported_media_type,
    validation_error,
    vllm_error_message,
)
from sidecar.wire import error_body

__all__ = [
    "HANDLER_ERROR_TYPES",
    "Origin",
    "Rejection",
    "handler_error_type",
    "handler_rejection",
    "pre_handler_rejection",
    "unsupported_media_type",
    "vllm_error_message",
]


class BodyView(msgspec.Struct):
    """The fields of an OpenAI request body the simulator reads; the rest is skipped."""

    model: Any = None
    messages: Any = msgspec.UNSET
    prompt: Any = msgspec.UNSET
    input: Any = msgspec.UNSET
    token_ids: Any = msgspec.UNSET  # /inference/v1/generate
    sampling_params: Any = None  # /inference/v1/generate
    stream: Any = None
    max_tokens: Any = None
    max_completion_tokens: Any = None
    max_output_tokens: Any = None
    stream_options: Any = None
    temperature: Any = None
    top_p: Any = None
    kv_transfer_params: Any = None


_VIEW_DECODER = msgspec.json.Decoder(BodyView)


@dataclass(frozen=True, slots=True)
class Markers:
    """Fault markers found in a prompt (see ``read_markers``)."""

    reject: int | None = None
    stream_error: int | None = None
    slow_headers: float = 0.0
    hang: bool = False
    drop_mid_stream: bool = False


NO_MARKERS = Markers()
_MARKER = re.compile(
    r"\[\[(?:(reject|stream-error):([45]\d\d)|slow-headers:(\d+(?:\.\d+)?)|(hang|drop-mid-stream))\]\]"
)


def read_markers(text: str) -> Markers:
    """Parse ``[[reject:N]]``, ``[[stream-error:N]]``, ``[[slow-headers:S]]``,
    ``[[hang]]`` and ``[[drop-mid-stream]]`` (N a 4xx/5xx status, S seconds).
    Anything else in double brackets is ordinary text."""
    if "[[" not in text:
        return NO_MARKERS
    found: dict[str, Any] = {}
    for match in _MARKER.finditer(text):
        kind, status, seconds, flag = match.groups()
        if kind is not None:
            found.setdefault(kind.replace("-", "_"), int(status))
        elif seconds is not None:
            found.setdefault("slow_headers", float(seconds))
        else:
            found[flag.replace("-", "_")] = True
    return Markers(**found) if found else NO_MARKERS


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    """A body that passed validation, reduced to what the handler decides on."""

    model: str | None
    stream: bool
    include_usage: bool
    prompt_tokens: int
    text: str
    max_tokens: int | None  # what the body asked (completions: 16 when it names none)
    max_tokens_param: str
    kv_transfer_params: dict[str, Any] | None
    temperature: float | None = None
    top_p: float | None = None
    route: str = "/v1/completions"
    data_parallel_rank: int | None = None  # the X-data-parallel-rank header, when an integer


def decode_view(body: bytes) -> BodyView | Rejection:
    """Decode the fields the simulator reads, or the 400 FastAPI answers for a bad body."""
    try:
        return _VIEW_DECODER.decode(body)
    except msgspec.ValidationError:
        try:
            value: Any = json.loads(body)
        except (ValueError, RecursionError):
            value = None
        return validation_error(
            "model_attributes_type",
            "body",
            "Input should be a valid dictionary or object to extract fields from",
            value,
        )
    except (msgspec.DecodeError, RecursionError):  # vLLM's JSON parser refuses deep nesting too
        return json_error(body)


def kv_params_of(view: BodyView) -> dict[str, Any] | None:
    """The body's ``kv_transfer_params`` when it is an object."""
    params = view.kv_transfer_params
    return params if isinstance(params, dict) else None


def validate(route: str, view: BodyView, vllm_errors: bool = False) -> ParsedRequest | Rejection:
    """Check the body like vLLM's request model for ``route`` (pydantic, before the handler);
    ``vllm_errors``: the model's own validators raise vLLM's error type (0.27.0+, below)."""
    values, errors = check_fields(route, msgspec.structs.asdict(view))
    counted = _count_prompt(route, view)
    if isinstance(counted, Rejection):  # a model-level check: pydantic reports it alone
        return counted
    stray = _stream_options_without_stream(route, view, vllm_errors)
    if stray is not None:  # another model-level check
        return stray
    if isinstance(counted, FieldError):
        return rejection_of(in_model_order(route, [counted, *errors]))
    if errors:
        return rejection_of(errors)
    tokens, text = counted
    max_tokens, param = _max_tokens(route, values)
    options = values.get("stream_options") or {}
    return ParsedRequest(
        model=values.get("model"),
        stream=values.get("stream") is True,
        include_usage=options.get("include_usage") is True,
        prompt_tokens=tokens,
        text=text,
        max_tokens=max_tokens,
        max_tokens_param=param,
        kv_transfer_params=values.get("kv_transfer_params"),
        temperature=values.get("temperature"),
        top_p=values.get("top_p"),
        route=route,
    )


def model_check(request: ParsedRequest, served_model: str) -> Rejection | None:
    """The handler's first check: a named model must be the served one."""
    if request.model and request.model != served_model:
        message = f"The model `{request.model}` does not exist. Valid aliases: {served_model}."
        return handler_rejection(404, message, "model")
    return None


def context_checks(request: ParsedRequest, max_model_len: int) -> Rejection | None:
    """Output budget vs context, prompt length vs context, then the sampling budget."""
    asked, param = request.max_tokens, request.max_tokens_param
    if asked is not None and asked > max_model_len:
        message = (
            f"{param}={asked} cannot be greater than max_model_len={max_model_len}. "
            "Please request fewer output tokens."
        )
        return handler_rejection(400, vllm_error_message(message, param, asked), param)
    tokens = request.prompt_tokens
    if tokens > max_model_len:
        message = (
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"prompt contains {tokens} input tokens, which exceeds this limit even without "
            "any output tokens. Please reduce the length of the input prompt."
        )
        return handler_rejection(400, vllm_error_message(message, "input_tokens", tokens), "input_tokens")
    if request.route == "/v1/responses" and tokens >= max_model_len:
        # The responses handler's own check (``_validate_generator_input``) after rendering: a
        # prompt of exactly max_model_len tokens, typed as OpenAI's Responses API types it.
        message = (
            f"The engine prompt length {tokens} exceeds the max_model_len {max_model_len}. "
            "Please reduce prompt."
        )
        return handler_rejection(400, message, "input", "invalid_request_error")
    budget = max_model_len - tokens if asked is None else min(asked, max_model_len - tokens)
    if budget < 1:
        message = f"max_tokens must be at least 1, got {budget}."
        return handler_rejection(400, vllm_error_message(message, "max_tokens", budget), "max_tokens")
    return None


def sampling_checks(request: ParsedRequest) -> Rejection | None:
    """``SamplingParams``' own checks, run in the handler once the prompt is rendered."""
    if request.temperature is not None and request.temperature < 0:
        message = f"temperature must be non-negative, got {float(request.temperature)}."
        return handler_rejection(
            400, vllm_error_message(message, "temperature", float(request.temperature)), "temperature"
        )
    if request.top_p is not None and not 0 < request.top_p <= 1:
        message = f"top_p must be in (0, 1], got {float(request.top_p)}."
        return handler_rejection(400, vllm_error_message(message, "top_p", float(request.top_p)), "top_p")
    return None


#: D's data-parallel size: the simulator is one engine.
DATA_PARALLEL_SIZE = 1


def rank_error(rank: int | None) -> str | None:
    """``AsyncLLM``'s refusal of an ``X-data-parallel-rank`` outside D's engines, if any.

    It is raised when the request reaches the engine client: inside the handler for a
    non-streaming request (400 ``BadRequestError``, D's fix notifies P), in-band after
    HTTP 200 for a stream (D's fix does not fire).
    """
    if rank is None or 0 <= rank < DATA_PARALLEL_SIZE:
        return None
    return f"data_parallel_rank {rank} is out of range [0, {DATA_PARALLEL_SIZE})."


def header_rank(value: str | None) -> int | None:
    """The ``X-data-parallel-rank`` header as vLLM reads it (an integer, else ignored)."""
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


PromptCount = tuple[int, str] | FieldError | Rejection


def _stream_options_without_stream(route: str, view: BodyView, vllm_errors: bool) -> Rejection | None:
    """vLLM's ``validate_stream_options`` (the chat and completions request models, a "before"
    model validator): ``stream_options`` given while ``stream`` is not true. A P/D router's
    prefill leg drops ``stream_options`` (it asks P for one token, not streamed), so such a
    request is refused by D alone, before its handler. From 0.27.0 the validator's
    ``VLLMValidationError`` is no ``ValueError``: it escapes pydantic and vLLM's own handler
    answers it, typed ``"BadRequestError"`` like a handler's error, still before the handler."""
    if route not in ("/v1/chat/completions", "/v1/completions"):
        return None
    if not view.stream_options or view.stream:
        return None
    message = "Stream options can only be defined when `stream=True`."
    if vllm_errors:
        body = error_body(f"{message} (parameter=stream_options)", 400, "BadRequestError", "stream_options")
        return Rejection(400, body, "pre_handler")
    msg = f"Value error, {message} (parameter=stream_options)"
    return validation_error("value_error", "body", msg, None, param="stream_options")


def _count_prompt(route: str, view: BodyView) -> PromptCount:
    if route in ("/v1/chat/completions", "/v1/messages"):
        return _count_messages(view.messages)
    if route == "/inference/v1/generate":
        return _count_token_ids(view.token_ids)
    if route == "/v1/completions":
        return _count_completion_prompt(view.prompt)
    return _count_responses_input(view.input)


def _count_messages(messages: Any) -> PromptCount:
    if messages is msgspec.UNSET:
        return FieldError("missing", "body.messages", "Field required", None)
    if not isinstance(messages, list):
        return FieldError("list_type", "body.messages", "Input should be a valid list", messages)
    texts = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            return FieldError(
                "dict_type", f"body.messages.{index}", "Input should be a valid dictionary", message
            )
        texts.append(_content_text(message.get("content")))
    text = "\n".join(texts)
    return len(text.split()), text


def _count_token_ids(value: Any) -> PromptCount:
    if value is msgspec.UNSET:
        return FieldError("missing", "body.token_ids", "Field required", None)
    if not isinstance(value, list) or not value or not all(_is_token_ids(t) for t in value):
        return FieldError("list_type", "body.token_ids", "Input should be a valid list", value)
    return len(value), ""


def _count_completion_prompt(prompt: Any) -> PromptCount:
    if prompt is msgspec.UNSET or prompt is None or prompt == "" or prompt == []:
        message = "Either prompt or prompt_embeds must be provided and non-empty."
        msg = f"Value error, {message} (parameter=prompt)"
        return validation_error("value_error", "body", msg, None, param="prompt")
    if isinstance(prompt, str):
        return len(prompt.split()), prompt
    if isinstance(prompt, list):
        if all(isinstance(item, str) for item in prompt):
            text = "\n".join(prompt)
            return len(text.split()), text
        if all(_is_token_ids(item) for item in prompt):
            return len(prompt), ""
        if all(isinstance(item, list) and all(map(_is_token_ids, item)) for item in prompt):
            return sum(len(item) for item in prompt), ""
    return FieldError("string_type", "body.prompt", "Input should be a valid string", prompt)


def _count_responses_input(value: Any) -> PromptCount:
    if value is msgspec.UNSET:
        return FieldError("missing", "body.input", "Field required", None)
    if isinstance(value, str):
        return len(value.split()), value
    if isinstance(value, list):
        text = "\n".join(
            _content_text(item.get("content")) if isinstance(item, dict) else str(item) for item in value
        )
        return len(text.split()), text
    return FieldError("string_type", "body.input", "Input should be a valid string", value)


def _content_text(content: Any) -> str:
    """Text of a message ``content``: a string or a list of parts with ``text``."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(
            part["text"] for part in content if isinstance(part, dict) and isinstance(part.get("text"), str)
        )
    return ""


def _is_token_ids(item: Any) -> bool:
    return isinstance(item, int) and not isinstance(item, bool) and item >= 0


COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # CompletionRequest.max_tokens's default


def _max_tokens(route: str, values: dict[str, Any]) -> tuple[int | None, str]:
    if route == "/v1/responses":
        return values.get("max_output_tokens"), "max_output_tokens"
    if route == "/inference/v1/generate":
        sampling = values.get("sampling_params") or {}
        asked = sampling.get("max_tokens")
        return (asked if isinstance(asked, int) else None), "max_tokens"
    if route == "/v1/chat/completions" and values.get("max_completion_tokens") is not None:
        return values["max_completion_tokens"], "max_completion_tokens"
    if route == "/v1/completions":
        return values.get("max_tokens", COMPLETIONS_DEFAULT_MAX_TOKENS), "max_tokens"
    return values.get("max_tokens"), "max_tokens"
