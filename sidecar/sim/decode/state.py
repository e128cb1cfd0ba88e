"""What the decode simulator remembers, and the seams it offers.

``DecodeHooks`` is the seam a NIXL-speaking "vLLM D" plugs into: it hears
about each remote-prefill request D admits and each one its handler rejects
(vLLM 0.21.0+ notifies P for those itself). ``SimState`` holds the bounded
request log served at ``GET /sim/log`` (``log_size`` entries at most, without
each request's ``kv_transfer_params`` unless ``log_params``) and the counters behind
``fail_first``, ``max_concurrency`` and ``/metrics``; one instance per app,
no module-level state. ``FrontMiddleware`` plays vLLM's middlewares that
answer before any route runs: ``x-request-id``, API-key auth and elastic-EP
scaling.
"""

from __future__ import annotations

import asyncio
import uuid
from collections import Counter, deque
from collections.abc import Callable
from typing import Any, Literal, Protocol

import msgspec
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from sidecar.sim.decode.config import COMPLETION_ROUTES, DecodeSimConfig
from sidecar.sim.decode.rejections import SCALING, UNAUTHORIZED
from sidecar.sim.decode.rules import BodyView, Origin, Rejection, kv_params_of
from sidecar.wire import lax_bool

Outcome = Literal["pending", "admitted", "rejected", "stream_error", "dropped", "cancelled", "aborted"]

#: Scope key holding the request id (the x-request-id header, or a generated one).
REQUEST_ID_KEY = "sim.request_id"
#: Status recorded (and passed to the hook) when the client leaves before an answer.
CLIENT_CLOSED = 499


class DecodeHooks(Protocol):
    """What happens to remote-prefill requests (``do_remote_prefill`` true) in D.

    ``admitted`` runs once D has accepted the request, before its first byte;
    ``rejected_in_handler`` runs when the completion handler rejects it or is
    cancelled by the client leaving, before the error is sent: exactly the
    cases vLLM 0.21.0+'s ``_with_kv_transfer_rejection_cleanup`` covers.
    Exceptions are logged and swallowed, as vLLM does.
    """

    async def admitted(self, request_id: str, route: str, kv_transfer_params: dict[str, Any]) -> None:
        """D admitted the request (it will read P's blocks)."""

    async def rejected_in_handler(
        self, request_id: str, route: str, kv_transfer_params: dict[str, Any], status: int
    ) -> None:
        """D's handler rejected the request with ``status`` (499: the client left)."""


class NoHooks:
    """The default ``DecodeHooks``: D speaks no NIXL and notifies nobody."""

    async def admitted(self, request_id: str, route: str, kv_transfer_params: dict[str, Any]) -> None:
        """Do nothing."""

    async def rejected_in_handler(
        self, request_id: str, route: str, kv_transfer_params: dict[str, Any], status: int
    ) -> None:
        """Do nothing."""


class LogEntry(msgspec.Struct, kw_only=True):
    """One completion request D saw; updated in place as its fate is decided.

    ``admitted`` is true when D accepted the request (outcomes ``admitted``
    and ``dropped``; ``aborted``: a shutting-down engine dropped it); ``origin``
    says where a refusal came from:
    ``pre_handler`` (middleware, validation, route), ``handler`` (what vLLM
    0.21.0+'s cleanup covers) or ``stream`` (in-band, after HTTP 200).
    ``kv_transfer_params`` is None unless the simulator runs with ``log_params``.
    """

    request_id: str
    route: str
    outcome: Outcome = "pending"
    status: int = 0
    origin: Origin | None = None
    admitted: bool = False
    stream: bool = False
    kv_transfer_params: dict[str, Any] | None = None


class SimState:
    """The request log and counters of one simulator app."""

    def __init__(self, log_size: int, log_params: bool = False) -> None:
        self.log: deque[LogEntry] = deque(maxlen=log_size)
        self.log_params = log_params
        self.outcomes: Counter[str] = Counter()
        self.arrivals = 0  # completion requests past the middlewares, for fail_first
        self.unfinished = 0  # past admission control and not yet answered

    def record(self, request_id: str, route: str, view: BodyView | Rejection) -> LogEntry:
        """Log a new completion request; the stream flag (and params, when kept) come from its body."""
        entry = LogEntry(request_id=request_id, route=route)
        if isinstance(view, BodyView):
            if self.log_params:
                entry.kv_transfer_params = kv_params_of(view)
            entry.stream = lax_bool(view.stream) is True
        self.log.append(entry)
        return entry

    def settle(self, entry: LogEntry, outcome: Outcome, status: int, origin: Origin | None) -> None:
        """Record a request's fate."""
        entry.outcome, entry.status, entry.origin = outcome, status, origin
        entry.admitted = outcome in ("admitted", "dropped")
        self.outcomes[outcome] += 1

    def reset(self) -> None:
        """Forget the log and the counters; requests in flight still count as unfinished."""
        self.log.clear()
        self.outcomes.clear()
        self.arrivals = 0


def do_remote_prefill(params: dict[str, Any] | None) -> bool:
    """Whether vLLM would treat the request as a remote-prefill one (truthy flag)."""
    return bool(params and params.get("do_remote_prefill"))


async def read_body(receive: Receive) -> bytes:
    """The whole request body (the simulator has no size limit, like vLLM)."""
    chunks = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return b""
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


async def send_json(send: Send, status: int, body: bytes) -> None:
    """Answer with a JSON body, no Starlette response object needed."""
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def is_json(scope: Scope) -> bool:
    """Whether the request's Content-Type is JSON (vLLM refuses anything else)."""
    for key, value in scope["headers"]:
        if key == b"content-type":
            return bool(value.split(b";", 1)[0].strip().lower() == b"application/json")
    return False


async def wait_for_disconnect(receive: Receive, seconds: float | None) -> bool:
    """Wait ``seconds`` (forever if None); True if the client left first."""

    async def disconnected() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    listener = asyncio.ensure_future(disconnected())
    try:
        done, _ = await asyncio.wait({listener}, timeout=seconds)
    finally:
        listener.cancel()
    return listener in done


_GUARDED = ("/v1", "/v2", "/inference", "/cohere")  # vLLM's AuthenticationMiddleware
_SCALING_EXEMPT = frozenset({"/health", "/is_scaling_elastic_ep"})
_CLOSE = (b"connection", b"close")


class FrontMiddleware:
    """vLLM's outer middlewares: echo x-request-id, API-key auth, elastic-EP scaling.

    Their refusals happen before any handler, so vLLM's own cleanup never
    sees them; ``on_refused`` logs those that hit a completion route. While
    ``closing()`` is true every answer says ``Connection: close``, as uvicorn's
    do once its server is exiting.
    """

    def __init__(
        self,
        app: ASGIApp,
        config: DecodeSimConfig,
        on_refused: Callable[[str, str, bytes, int], None],
        closing: Callable[[], bool] = lambda: False,
    ) -> None:
        self.app = app
        self.api_key = config.api_key
        self.scaling = config.scaling
        self.on_refused = on_refused
        self.closing = closing

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = _header(scope, b"x-request-id") or uuid.uuid4().hex
        scope[REQUEST_ID_KEY] = request_id
        echoed = (b"x-request-id", request_id.encode("latin-1"))

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                close = [_CLOSE] if self.closing() else []
                message["headers"] = [*message.get("headers", ()), echoed, *close]
            await send(message)

        refusal = self._refusal(scope)
        if refusal is None:
            await self.app(scope, receive, send_with_id)
            return
        status, body = refusal
        if scope["path"] in COMPLETION_ROUTES and scope["method"] == "POST":
            self.on_refused(request_id, scope["path"], await read_body(receive), status)
        await send_json(send_with_id, status, body)

    def _refusal(self, scope: Scope) -> tuple[int, bytes] | None:
        path: str = scope["path"]
        guarded = scope["method"] != "OPTIONS" and path.startswith(_GUARDED)
        if self.api_key is not None and guarded and not self._authorized(scope):
            return 401, UNAUTHORIZED
        exempt = path in _SCALING_EXEMPT or path.startswith("/sim/")
        if self.scaling and not exempt:
            return 503, SCALING
        return None

    def _authorized(self, scope: Scope) -> bool:
        scheme, _, token = (_header(scope, b"authorization") or "").partition(" ")
        return scheme.lower() == "bearer" and token == self.api_key


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            text: str = value.decode("latin-1")
            return text
    return None
