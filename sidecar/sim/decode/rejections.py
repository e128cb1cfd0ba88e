"""The decode simulator's rejections: vLLM's error bodies and types, and where each comes from.

A handler error is typed by its status (0.33.0 ``create_error_response``); a
body that fails validation is answered 400 typed ``"Bad Request"`` (the HTTP
phrase) with one line per error, as vLLM's ``RequestValidationError`` handler
writes it. ``sidecar.sim.decode.rules`` decides which one a body gets.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, Literal

from sidecar.sim.decode.fields import ROUTE_FIELDS, FieldError
from sidecar.wire import error_body

Origin = Literal["pre_handler", "handler", "stream"]

#: ``type`` of a handler error by status (0.33.0 ``create_error_response``).
HANDLER_ERROR_TYPES = {
    400: "BadRequestError",
    404: "NotFoundError",
    422: "UnprocessableEntityError",
    500: "InternalServerError",
    501: "NotImplementedError",
    503: "ServiceUnavailableError",
}


def handler_error_type(status: int) -> str:
    """The ``type`` vLLM gives a handler error with this status."""
    return HANDLER_ERROR_TYPES.get(status, "BadRequestError")


#: What vLLM's outer middlewares answer before any handler: the API key's (401) and elastic-EP
#: scaling's (503), ``{"error": ...}`` with no type. No 503 on a completion route comes from
#: anywhere else before the handler: vLLM types a 503 ``"ServiceUnavailableError"`` only in
#: ``create_error_response``, for a ``RetryableRequestError`` the engine sent back (0.33.0+),
#: and ``"Service Unavailable"`` for admission control, in the handler (0.29.0+).
UNAUTHORIZED = b'{"error":"Unauthorized"}'
SCALING = b'{"error":"The model is currently scaling. Please try again later."}'
_MIDDLEWARE_BODIES = {401: UNAUTHORIZED, 503: SCALING}


def pre_handler_rejection(status: int, message: str) -> Rejection:
    """A refusal of ``status`` before any handler, as vLLM answers it: the middleware's body for
    401 and 503, else an ``HTTPException``'s (typed with the HTTP phrase, vLLM's
    ``http_exception_handler``)."""
    body = _MIDDLEWARE_BODIES.get(status) or error_body(message, status, HTTPStatus(status).phrase)
    return Rejection(status, body, "pre_handler")


@dataclass(frozen=True, slots=True)
class Rejection:
    """A non-200 answer: status, encoded body and where in vLLM it comes from."""

    status: int
    body: bytes
    origin: Origin


def handler_rejection(status: int, message: str, param: str | None = None, kind: str = "") -> Rejection:
    """A rejection raised inside a completion handler (vLLM's cleanup wrapper sees it), typed
    ``kind`` or by its status."""
    body = error_body(message, status, kind or handler_error_type(status), param)
    return Rejection(status, body, "handler")


def vllm_error_message(message: str, parameter: str, value: object) -> str:
    """``str()`` of a ``VLLMValidationError``: the message plus its parameter and value."""
    return f"{message} (parameter={parameter}, value={value})"


def in_model_order(route: str, errors: list[FieldError]) -> list[FieldError]:
    """Errors in the order the route's model declares their fields, as pydantic reports them."""
    order = [name for name, _ in ROUTE_FIELDS[route]]
    return sorted(errors, key=lambda error: order.index(error.loc.split(".")[1]))


def _summarize(value: Any) -> Any:
    """The bounded stand-in vLLM 0.33.0 puts under a validation error's ``input``: containers
    described, anything else as text of at most 200 characters."""
    if isinstance(value, list | tuple | set | frozenset | dict):
        return f"<{type(value).__name__} of {len(value)} items>"
    text = value if isinstance(value, str) or value is None else str(value)
    if isinstance(text, str) and len(text) > 200:
        return text[:200] + "...[truncated]"
    return text


def rejection_of(errors: list[FieldError], param: str | None = None) -> Rejection:
    """A 400 like vLLM's ``RequestValidationError`` handler: type is the HTTP phrase, ``param``
    the first error's location, the message one line per error."""
    lines = []
    for error in errors:
        shown: dict[str, Any] = {"type": error.type, "loc": error.loc, "msg": error.msg}
        shown["input"] = _summarize(error.input)
        if error.ctx is not None:
            shown["ctx"] = error.ctx
        lines.append(f"  {shown!r}")
    label = "error" if len(errors) == 1 else "errors"
    message = f"{len(errors)} validation {label}:\n" + "\n".join(lines)
    return Rejection(400, error_body(message, 400, "Bad Request", param or errors[0].loc), "pre_handler")


def validation_error(
    kind: str, loc: str, msg: str, value: Any, param: str | None = None, ctx: Any = None
) -> Rejection:
    """``rejection_of`` a single error."""
    return rejection_of([FieldError(kind, loc, msg, value, ctx)], param)


def json_error(body: bytes) -> Rejection:
    try:
        json.loads(body)
    except json.JSONDecodeError as exc:
        loc, ctx = f"body.{exc.pos}", {"error": exc.msg}
    except (ValueError, RecursionError) as exc:  # not UTF-8, or nested past the parser's limit
        loc, ctx = "body", {"error": str(exc)}
    else:  # valid for json, not for msgspec (e.g. NaN): report it like a decode error
        loc, ctx = "body", {"error": "Invalid JSON"}
    return validation_error("json_invalid", loc, "JSON decode error", {}, ctx=ctx)


def unsupported_media_type() -> Rejection:
    """vLLM's answer to a completion request whose Content-Type is not JSON."""
    message = "1 validation error:\n  Unsupported Media Type: Only 'application/json' is allowed"
    return Rejection(400, error_body(message, 400, "Bad Request"), "pre_handler")
