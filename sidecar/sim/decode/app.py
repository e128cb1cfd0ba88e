"""The fake vLLM decode server D (``kv-release-sidecar sim-decode``).

A Starlette app that answers the OpenAI completion routes the way vLLM
0.33.0 does, with failure knobs (``DecodeSimConfig``) and per-request fault
markers in the prompt (``[[reject:503]]``, ``[[stream-error:400]]``,
``[[hang]]``, ``[[drop-mid-stream]]``, ``[[slow-headers:0.5]]``). Each
refusal is tagged with where vLLM would raise it: ``pre_handler``
(middleware, validation, route), ``handler`` (model, admission control,
context length, markers; covered by vLLM 0.21.0+'s own cleanup, so
``DecodeHooks.rejected_in_handler`` runs for remote-prefill requests) or
``stream`` (in-band after HTTP 200). Every completion request is logged at
``GET /sim/log``; ``POST /sim/reset`` forgets them. ``POST /sim/engine`` makes D's
engine dead or shutting down, or drops its KV connector (``decode_engine``); D
then notifies P for nothing. The request flow lives in
this module; the command (``kv-release-sidecar sim-decode``) in ``command``;
rules, rejections, bodies, state, info routes and config in the sibling
modules of ``sidecar.sim.decode``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

import msgspec
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from sidecar.sim.decode import anthropic
from sidecar.sim.decode.bodies import DONE_EVENT, Answers, reply_for, sse_error_event
from sidecar.sim.decode.config import (
    COMPLETION_ROUTES,
    DecodeSimConfig,
    add_arguments,
)
from sidecar.sim.decode.engine import EngineState, engine_routes
from sidecar.sim.decode.info import http_error, info_routes
from sidecar.sim.decode.rules import (
    BodyView,
    Markers,
    ParsedRequest,
    Rejection,
    context_checks,
    decode_view,
    handler_error_type,
    handler_rejection,
    header_rank,
    model_check,
    pre_handler_rejection,
    rank_error,
    read_markers,
    sampling_checks,
    unsupported_media_type,
    validate,
)
from sidecar.sim.decode.state import (
    CLIENT_CLOSED,
    REQUEST_ID_KEY,
    DecodeHooks,
    FrontMiddleware,
    LogEntry,
    NoHooks,
    SimState,
    do_remote_prefill,
    is_json,
    read_body,
    send_json,
    wait_for_disconnect,
)
from sidecar.wire import error_body

__all__ = [
    "DecodeHooks",
    "DecodeSimConfig",
    "LogEntry",
    "NoHooks",
    "SimulatedDrop",
    "add_arguments",
    "create_decode_app",
]

logger = logging.getLogger(__name__)

#: ``VLLMValidationError`` is no ``ValueError`` from here: a request model's validator raising it is
#: answered by vLLM's own error handler, typed "BadRequestError" (still before the handler).
VLLM_ERRORS_SINCE = (0, 27, 0)
_API_NAMES = {
    "/v1/chat/completions": "Chat Completions API",
    "/v1/completions": "Completions API",
    "/v1/responses": "Responses API",
    "/v1/messages": "Messages API",
    "/inference/v1/generate": "generate tokens API",
}
# vLLM 0.29.0+ admission control (QueueOverflowError): a GracefulHTTPError, type is the phrase.
_QUEUE_FULL = Rejection(
    503,
    error_body(
        "The engine is currently busy and cannot accept new requests. "
        "Please try again later or on a different instance.",
        503,
        "Service Unavailable",
    ),
    "handler",
)


class SimulatedDrop(Exception):
    """Raised inside a response body so the server aborts the connection mid-answer."""


class DecodeSim:
    """One simulated D: config, hooks, state and the completion request flow."""

    def __init__(self, config: DecodeSimConfig, hooks: DecodeHooks) -> None:
        self.config = config
        self.hooks = hooks
        self.state = SimState(config.log_size, config.log_params)
        self.engine = EngineState(config)
        self.answers = Answers(config)

    async def completion(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Serve one request to a completion route (an ASGI endpoint)."""
        route: str = scope["path"]
        view = decode_view(await read_body(receive))
        entry = self.state.record(scope[REQUEST_ID_KEY], route, view)
        self.state.arrivals += 1
        failure = self._failure() if self.state.arrivals <= self.config.fail_first else None
        parsed = self._pre_handler(route, scope, view, failure)
        if isinstance(parsed, Rejection):
            await self._reject(entry, parsed, None, send)
            return
        check = (
            model_check(parsed, self.config.model)
            or self.engine.dead_rejection()
            or self.engine.faulted_rejection()
        )
        if check is None and not self._admit():
            check = _QUEUE_FULL
        if check is not None:
            await self._reject(entry, check, parsed.kv_transfer_params, send)
            return
        try:
            await self._admitted_flow(entry, parsed, failure, scope, receive, send)
        finally:
            self.state.unfinished -= 1

    def refused_by_middleware(self, request_id: str, route: str, body: bytes, status: int) -> None:
        """Log a completion request the front middleware refused."""
        entry = self.state.record(request_id, route, decode_view(body))
        self.state.settle(entry, "rejected", status, "pre_handler")

    def _pre_handler(
        self, route: str, scope: Scope, view: BodyView | Rejection, failure: Rejection | None
    ) -> ParsedRequest | Rejection:
        config = self.config
        if failure is not None and failure.origin == "pre_handler":
            return failure
        if not is_json(scope):
            return unsupported_media_type()
        if isinstance(view, Rejection):
            return view
        parsed = validate(route, view, vllm_errors=self.engine.release >= VLLM_ERRORS_SINCE)
        if not isinstance(parsed, Rejection) and route in config.disabled_routes:
            message = f"The model does not support {_API_NAMES[route]}"
            return Rejection(501, error_body(message, 501, "NotImplementedError"), "pre_handler")
        if isinstance(parsed, Rejection):
            return parsed
        rank = dict(scope["headers"]).get(b"x-data-parallel-rank")
        return dataclasses.replace(parsed, data_parallel_rank=header_rank(rank.decode() if rank else None))

    def _failure(self) -> Rejection:
        """The ``fail_first`` answer for the request that just arrived."""
        status, origin = self.config.fail_status, self.config.fail_origin
        message = f"sim-decode: fail_first rejection {self.state.arrivals} of {self.config.fail_first}"
        if origin == "pre_handler":
            return pre_handler_rejection(status, message)
        return Rejection(status, error_body(message, status, handler_error_type(status)), origin)

    def _admit(self) -> bool:
        limit = self.config.max_concurrency
        if limit and self.state.unfinished >= limit:
            return False
        self.state.unfinished += 1
        return True

    async def _admitted_flow(
        self,
        entry: LogEntry,
        request: ParsedRequest,
        failure: Rejection | None,
        scope: Scope,
        receive: Receive,
        send: Send,
    ) -> None:
        """Past admission control: wait (latency, markers), decide, answer."""
        config, params = self.config, request.kv_transfer_params
        markers = read_markers(request.text)
        hang = config.hang or markers.hang
        delay = config.latency + markers.slow_headers
        if (hang or delay > 0) and await self._client_left(entry, params, receive, hang, delay):
            return
        rejection = self._handler_rejection(request, markers, failure)
        if rejection is not None:
            await self._reject(entry, rejection, params, send)
            return
        if self.engine.mode == "shutting_down":  # the engine core drops the request on arrival
            self.state.settle(entry, "aborted", 200, None)
            response = self._answer(entry, request, False, aborted=True)
        elif markers.stream_error is not None and request.stream:
            self.state.settle(entry, "stream_error", 200, "stream")
            response = self._stream_error(entry, request, markers.stream_error)
        elif (refused := rank_error(request.data_parallel_rank)) is not None:  # streams only here
            self.state.settle(entry, "stream_error", 200, "stream")
            response = _sse(self._events([sse_error_event(refused, 400, "BadRequestError"), DONE_EVENT]))
        else:
            drop = markers.drop_mid_stream or (request.stream and config.drop_mid_stream)
            self.state.settle(entry, "dropped" if drop else "admitted", 200, None)
            await self._notify_admitted(entry, params)
            response = self._answer(entry, request, drop)
        await response(scope, receive, send)

    def _handler_rejection(
        self, request: ParsedRequest, markers: Markers, failure: Rejection | None
    ) -> Rejection | None:
        if failure is not None:
            return failure
        if markers.reject is not None:
            return _marker_rejection("reject", markers.reject)
        check = context_checks(request, self.config.max_model_len) or sampling_checks(request)
        if check is None and markers.stream_error is not None and not request.stream:
            # Without streaming, the engine's refusal surfaces inside the handler.
            return _marker_rejection("stream-error", markers.stream_error)
        refused = rank_error(request.data_parallel_rank)
        if check is None and refused is not None and not request.stream:
            return handler_rejection(400, refused)
        return check

    async def _client_left(
        self,
        entry: LogEntry,
        params: dict[str, Any] | None,
        receive: Receive,
        hang: bool,
        delay: float,
    ) -> bool:
        """Wait in the handler; a client leaving first cancels it, which vLLM's cleanup
        (0.21.0+) treats as a rejection."""
        try:
            left = await wait_for_disconnect(receive, None if hang else delay)
        except asyncio.CancelledError:
            await self._cancelled(entry, params)
            raise
        if left:
            await self._cancelled(entry, params)
        return left

    async def _cancelled(self, entry: LogEntry, params: dict[str, Any] | None) -> None:
        self.state.settle(entry, "cancelled", CLIENT_CLOSED, "handler")
        await self._notify_rejected(entry, params, CLIENT_CLOSED)

    async def _reject(
        self, entry: LogEntry, rejection: Rejection, params: dict[str, Any] | None, send: Send
    ) -> None:
        self.state.settle(entry, "rejected", rejection.status, rejection.origin)
        body = rejection.body
        if rejection.origin == "handler":
            await self._notify_rejected(entry, params, rejection.status)
            if entry.route == anthropic.ROUTE:  # the handler's errors in Anthropic's envelope
                body = anthropic.error_body(_message_of(body), rejection.status)
        await send_json(send, rejection.status, body)

    async def _notify_rejected(self, entry: LogEntry, params: dict[str, Any] | None, status: int) -> None:
        if params is None or not do_remote_prefill(params) or not self.engine.notifies:
            return
        try:
            await self.hooks.rejected_in_handler(entry.request_id, entry.route, params, status)
        except Exception:
            logger.warning("rejected_in_handler hook failed for %s", entry.request_id, exc_info=True)

    async def _notify_admitted(self, entry: LogEntry, params: dict[str, Any] | None) -> None:
        if params is None or not do_remote_prefill(params) or not self.engine.notifies:
            return
        try:
            await self.hooks.admitted(entry.request_id, entry.route, params)
        except Exception:
            logger.warning("admitted hook failed for %s", entry.request_id, exc_info=True)

    def _stream_error(self, entry: LogEntry, request: ParsedRequest, status: int) -> Response:
        """HTTP 200, then the engine's refusal in-band (vLLM's in-band stream error)."""
        if entry.route == "/v1/responses":
            # vLLM 0.33.0 lets the error escape the Responses stream: the connection is cut
            # after response.created and response.in_progress.
            events = self.answers.stream(reply_for(self.config, entry.route, entry.request_id, request))
            return _sse(self._events(events, drop_at=2))
        message = f"sim-decode: the engine refused the request ([[stream-error:{status}]])"
        error = sse_error_event(message, status, handler_error_type(status))
        if entry.route == anthropic.ROUTE:
            return _sse(self._events([anthropic.error_event(message, status)]))
        return _sse(self._events([error, DONE_EVENT]))

    def _answer(self, entry: LogEntry, request: ParsedRequest, drop: bool, aborted: bool = False) -> Response:
        reply = reply_for(self.config, entry.route, entry.request_id, request)
        if aborted:
            reply = dataclasses.replace(reply, tokens=0, finished=False, cached_tokens=0, aborted=True)
        elif not self.engine.kv_connector:  # D ignored P's parameters and prefilled itself
            reply = dataclasses.replace(reply, cached_tokens=0)
        if request.stream:
            events = self.answers.stream(reply)
            drop_at = min(self.config.drop_after, len(events) - 1) if drop else None
            return _sse(self._events(events, drop_at))
        body = self.answers.full(reply)
        if drop:
            half = self._events([body[: len(body) // 2]], drop_at=1)
            return StreamingResponse(half, media_type="application/json")
        return Response(body, media_type="application/json")

    async def _events(self, events: list[bytes], drop_at: int | None = None) -> AsyncIterator[bytes]:
        """Yield events ``event_delay`` apart; with ``drop_at``, cut after that many."""
        delay = self.config.event_delay
        for index, event in enumerate(events):
            if index == drop_at:
                break
            if index and delay:
                await asyncio.sleep(delay)
            yield event
        if drop_at is not None:
            raise SimulatedDrop(f"sim-decode: connection cut after {drop_at} event(s)")


def _message_of(body: bytes) -> str:
    """The message of an OpenAI-shaped error body."""
    error = msgspec.json.decode(body).get("error") or {}
    return str(error.get("message", ""))


def _marker_rejection(kind: str, status: int) -> Rejection:
    message = f"sim-decode: rejected by marker [[{kind}:{status}]]"
    return handler_rejection(status, message)


def _sse(body: AsyncIterator[bytes]) -> StreamingResponse:
    return StreamingResponse(body, media_type="text/event-stream")


class _CompletionEndpoint:
    """Raw ASGI endpoint of one completion route, so the body is read exactly once."""

    def __init__(self, sim: DecodeSim) -> None:
        self.sim = sim

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.sim.completion(scope, receive, send)


def create_decode_app(config: DecodeSimConfig, hooks: DecodeHooks | None = None) -> Starlette:
    """Build the simulator app for ``config``; ``hooks`` defaults to ``NoHooks``."""
    sim = DecodeSim(config, hooks if hooks is not None else NoHooks())
    endpoint = _CompletionEndpoint(sim)
    routes = [Route(path, endpoint, methods=["POST"]) for path in COMPLETION_ROUTES]
    routes += info_routes(config, sim.state, sim.engine) + engine_routes(sim.engine)
    refused, closing = sim.refused_by_middleware, lambda: sim.engine.closing
    middleware = [Middleware(FrontMiddleware, config=config, on_refused=refused, closing=closing)]
    app = Starlette(
        routes=routes,
        middleware=middleware,
        exception_handlers={HTTPException: http_error},
        lifespan=_hooks_lifespan(sim.hooks),
    )
    app.state.sim = sim
    return app


def _hooks_lifespan(hooks: DecodeHooks) -> Callable[[Starlette], AbstractAsyncContextManager[None]]:
    """Start and close hooks that own resources (the "vLLM D" NIXL client)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        start, close = getattr(hooks, "start", None), getattr(hooks, "close", None)
        if start is not None:
            await start()
        try:
            yield
        finally:
            if close is not None:
                await close()

    return lifespan
