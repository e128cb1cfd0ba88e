"""Wire messages the sidecar reads and writes on the HTTP side, as msgspec Structs.

Every Struct names the vLLM releases it belongs to. The NIXL side-channel
messages (handshake requests and payloads per release) live in
``sidecar.nixl.messages``; this module holds the OpenAI-request view, the
``kv_transfer_params`` the release path trusts, and vLLM's error body.
Decoders are built once at import and reused.
"""

from __future__ import annotations

from typing import Any

import msgspec


class RequestView(msgspec.Struct):
    """The only fields of an OpenAI request body the proxy decodes.

    Types are deliberately loose: a body whose ``stream`` is not a bool is D's
    to reject, not ours; we only need to know what D will see.
    """

    stream: Any = False
    n: Any = None
    kv_transfer_params: msgspec.Raw = msgspec.Raw(b"null")
    # vLLM < 0.13.0 names a /v1/responses request by this body field (P's id too).
    request_id: Any = None


class KVTransferParams(msgspec.Struct, kw_only=True, frozen=True):
    """``kv_transfer_params`` as P emits them and D consumes them (vLLM 0.9.0-0.34.0).

    Unknown keys are ignored (newer releases append fields). Required-for-release
    fields are optional here; ``sidecar.params.check`` decides whether a
    request can be released and says why not.
    """

    do_remote_prefill: bool = False
    do_remote_decode: bool = False
    remote_engine_id: str | None = None
    remote_request_id: str | None = None  # 0.13.0+
    remote_host: str | None = None
    remote_port: int | None = None
    # Flat list (<=0.17.x) or list of per-KV-cache-group lists (0.18.0+).
    remote_block_ids: list[Any] | None = None
    tp_size: int = 1  # 0.9.2+
    pp_size: int | None = None  # 0.26.0+ push, 0.29.0+ pull
    dcp_size: int | None = None  # 0.29.0+
    transfer_mode: str | None = None  # 0.28.0+: "pull" or "push"
    remote_num_tokens: int | None = None  # 0.21.0+
    remote_registration_generation: int | None = None  # 0.33.0 (pull)


class ParamsView(msgspec.Struct, kw_only=True, frozen=True):
    """The fields of ``kv_transfer_params`` the proxy reads (``sidecar.params.check``).

    Like ``KVTransferParams``, but ``remote_block_ids`` stays raw JSON: the proxy
    only counts the ids and checks their shape, and never makes Python objects
    of what may be hundreds of thousands of them.
    """

    do_remote_prefill: bool = False
    do_remote_decode: bool = False  # unread, but typed: mistyped parameters are never released
    remote_engine_id: str | None = None
    remote_request_id: str | None = None
    remote_host: str | None = None
    remote_port: int | None = None
    remote_block_ids: msgspec.Raw = msgspec.Raw(b"null")
    tp_size: int = 1
    pp_size: int | None = None
    dcp_size: int | None = None
    transfer_mode: str | None = None
    remote_num_tokens: int | None = None
    remote_registration_generation: int | None = None


class ErrorInfo(msgspec.Struct):
    """vLLM's ``ErrorInfo`` (0.10.1+)."""

    message: str
    type: str
    param: str | None
    code: int


class ErrorResponse(msgspec.Struct):
    """vLLM's nested OpenAI error body: ``{"error": {...}}`` (0.10.1+)."""

    error: ErrorInfo


class AnthropicError(msgspec.Struct):
    """The error of vLLM's ``AnthropicErrorResponse`` (``/v1/messages``): its type is vLLM's
    own before 0.33.0 (``BadRequestError``...), Anthropic's name for the status from 0.33.0."""

    type: str
    message: str


class AnthropicErrorResponse(msgspec.Struct, tag_field="type", tag="error"):
    """``{"type": "error", "error": {"type", "message"}}``: how ``/v1/messages`` answers its
    handler's errors (no ``code``; the status is the HTTP status)."""

    error: AnthropicError


class PrefillAnswerView(msgspec.Struct):
    """What router mode reads of P's answer to the prefill leg (any route, any vLLM release): its
    ``kv_transfer_params`` and ``usage``, as they come (checked by the reader); the rest of the
    answer is skipped, never turned into Python objects."""

    kv_transfer_params: Any = None
    usage: Any = None


_TRUE_TEXT = frozenset({"1", "t", "y", "on", "yes", "true"})
_FALSE_TEXT = frozenset({"0", "f", "n", "no", "off", "false"})


def lax_bool(value: Any) -> bool | None:
    """``value`` as vLLM's request models (pydantic, lax mode) read a bool, or None when they
    refuse it: a bool; 0 or 1 (int or float); ``"true"``, ``"yes"``, ``"on"``, ``"1"``...
    (case-insensitive, pydantic-core ``str_as_bool``)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int | float):
        return bool(value) if value in (0, 1) else None
    if isinstance(value, str):
        text = value.lower()
        if text in _TRUE_TEXT:
            return True
        if text in _FALSE_TEXT:
            return False
    return None


VIEW_DECODER = msgspec.json.Decoder(RequestView)
PARAMS_VIEW_DECODER = msgspec.json.Decoder(ParamsView)
ERROR_DECODER = msgspec.json.Decoder(ErrorResponse)
PREFILL_ANSWER_DECODER = msgspec.json.Decoder(PrefillAnswerView)
ANTHROPIC_ERROR_DECODER = msgspec.json.Decoder(AnthropicErrorResponse)
ENCODER = msgspec.json.Encoder()


def error_body(message: str, status: int, type_: str, param: str | None = None) -> bytes:
    """Encode an error in vLLM's OpenAI shape; ``code`` equals the HTTP status."""
    return ENCODER.encode(ErrorResponse(ErrorInfo(message, type_, param, status)))
