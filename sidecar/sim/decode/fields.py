"""The request fields the decode simulator reads, checked as vLLM 0.33.0's request models check them.

vLLM declares its request bodies as pydantic models read in lax mode from
JSON: an ``int`` field takes ``5``, ``5.0``, ``"5"`` or ``true``, a
``float`` field takes ``"0.5"``, a ``bool`` field takes ``"yes"``; anything
else is a validation error with pydantic's ``type``, ``loc`` and ``msg``.
``check_fields`` applies those rules to the fields the simulator reads, in
the order each route's model declares them (pydantic reports its errors in
that order), and returns the converted values with every error found. The
prompt fields (``messages``, ``prompt``, ``input``) are counted by
``decode_rules``, which also turns the errors into vLLM's 400 body.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from sidecar.wire import lax_bool

Kind = Literal["prompt", "str", "bool", "int", "float", "dict", "stream_options"]

CHAT, COMPLETIONS, RESPONSES = "/v1/chat/completions", "/v1/completions", "/v1/responses"
MESSAGES, GENERATE = "/v1/messages", "/inference/v1/generate"
#: Per route, the fields read, in the order vLLM 0.33.0's request model declares them.
ROUTE_FIELDS: dict[str, tuple[tuple[str, Kind], ...]] = {
    CHAT: (
        ("messages", "prompt"),
        ("model", "str"),
        ("max_tokens", "int"),
        ("max_completion_tokens", "int"),
        ("stream", "bool"),
        ("stream_options", "stream_options"),
        ("temperature", "float"),
        ("top_p", "float"),
        ("kv_transfer_params", "dict"),
    ),
    COMPLETIONS: (
        ("model", "str"),
        ("prompt", "prompt"),
        ("max_tokens", "int"),
        ("stream", "bool"),
        ("stream_options", "stream_options"),
        ("temperature", "float"),
        ("top_p", "float"),
        ("kv_transfer_params", "dict"),
    ),
    RESPONSES: (
        ("input", "prompt"),
        ("max_output_tokens", "int"),
        ("model", "str"),
        ("stream", "bool"),
        ("temperature", "float"),
        ("top_p", "float"),
        ("kv_transfer_params", "dict"),
    ),
    MESSAGES: (  # AnthropicMessagesRequest
        ("model", "str"),
        ("messages", "prompt"),
        ("max_tokens", "int"),
        ("stream", "bool"),
        ("temperature", "float"),
        ("top_p", "float"),
        ("kv_transfer_params", "dict"),
    ),
    GENERATE: (  # GenerateRequest
        ("token_ids", "prompt"),
        ("sampling_params", "dict"),
        ("model", "str"),
        ("stream", "bool"),
        ("stream_options", "stream_options"),
        ("kv_transfer_params", "dict"),
    ),
}
_STREAM_OPTIONS = ("include_usage", "continuous_usage_stats")  # vLLM's StreamOptions, both bool
_MESSAGES = {
    "string_type": "Input should be a valid string",
    "dict_type": "Input should be an object",  # pydantic's wording for JSON input
    "bool_parsing": "Input should be a valid boolean, unable to interpret input",
    "bool_type": "Input should be a valid boolean",
    "int_from_float": "Input should be a valid integer, got a number with a fractional part",
    "int_parsing_size": "Unable to parse input string as an integer, exceeded maximum size",
    "int_parsing": "Input should be a valid integer, unable to parse string as an integer",
    "int_type": "Input should be a valid integer",
    "float_parsing": "Input should be a valid number, unable to parse string as a number",
    "float_type": "Input should be a valid number",
    "model_type": "Input should be an object",
}
_INT_LIMIT = 2**63  # pydantic-core parses a float into an int only below i64's range


@dataclass(frozen=True, slots=True)
class FieldError:
    """One pydantic error: ``loc`` is the dotted path FastAPI reports (``body.temperature``)."""

    type: str
    loc: str
    msg: str
    input: Any
    ctx: dict[str, Any] | None = None


class _Invalid(Exception):
    """A refused value; ``at`` and ``value`` locate it inside the field (``.include_usage``)."""

    def __init__(self, type_: str, ctx: dict[str, Any] | None = None) -> None:
        super().__init__(_MESSAGES[type_])
        self.type, self.msg, self.ctx = type_, _MESSAGES[type_], ctx
        self.at, self.value = "", None


def check_fields(route: str, body: dict[str, Any]) -> tuple[dict[str, Any], list[FieldError]]:
    """The converted values of the scalar fields ``route`` reads (absent or null ones are left
    out), and every error, in the model's order. Prompt fields are left to the caller."""
    values: dict[str, Any] = {}
    errors: list[FieldError] = []
    for name, kind in ROUTE_FIELDS[route]:
        value = body.get(name)
        if kind == "prompt" or value is None:
            continue
        try:
            values[name] = convert(kind, value)
        except _Invalid as exc:
            found = exc.value if exc.at else value
            errors.append(FieldError(exc.type, f"body.{name}{exc.at}", exc.msg, found, exc.ctx))
    return values, errors


def convert(kind: Kind, value: Any) -> Any:
    """``value`` as pydantic reads a JSON value into a field of ``kind`` (lax mode)."""
    if kind == "str":
        if isinstance(value, str):
            return value
        raise _Invalid("string_type")
    if kind == "bool":
        return _bool(value)
    if kind == "int":
        return _int(value)
    if kind == "float":
        return _float(value)
    if kind == "dict":
        if isinstance(value, dict):
            return value
        raise _Invalid("dict_type")
    return _stream_options(value)


def _bool(value: Any) -> bool:
    read = lax_bool(value)
    if read is not None:
        return read
    if isinstance(value, str | int | float):
        raise _Invalid("bool_parsing")
    raise _Invalid("bool_type")


def _int(value: Any) -> int:
    if isinstance(value, int):  # bool included: pydantic's lax mode reads true as 1
        return int(value)
    if isinstance(value, float):
        if not value.is_integer():
            raise _Invalid("int_from_float")
        if abs(value) >= _INT_LIMIT:
            raise _Invalid("int_parsing_size")
        return int(value)
    if isinstance(value, str):
        try:
            return int(value)
        except ValueError:
            raise _Invalid("int_parsing") from None
    raise _Invalid("int_type")


def _float(value: Any) -> float:
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            raise _Invalid("float_parsing") from None
    raise _Invalid("float_type")


def _stream_options(value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _Invalid("model_type", {"class_name": "StreamOptions"})
    options = dict(value)
    for name in _STREAM_OPTIONS:
        if options.get(name) is not None:
            try:
                options[name] = _bool(options[name])
            except _Invalid as exc:
                exc.at, exc.value = f".{name}", options[name]
                raise
    return options
