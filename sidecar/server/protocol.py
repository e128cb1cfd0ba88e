"""Client limits on the sidecar's ports: uvicorn's httptools protocol plus what it lacks.

Both servers speak HTTP/1.1 through ``GuardedProtocol``: uvicorn's httptools
protocol plus the client limits it lacks (``docs/limits.md``). uvicorn 0.54
with httptools has no header size limit (llhttp accumulates any header), no
timer on a connection before its first response (a client trickling a header
block, or one never sending, holds its connection forever; the keep-alive
timer runs only after a response) and none on a request body; its
``limit_concurrency`` counts idle connections and answers plain text.
``GuardedProtocol`` answers 431 over ``max_header_bytes``, 408 past
``client_header_timeout`` or ``client_body_timeout`` (then closes), and
marks a request above ``limit_concurrency`` requests in flight
(``over_limit``): the app it serves must answer such a request with a 503
and ``connection: close`` (``Proxy`` does, after reading an inspected body
so that the blocks it names are released).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from http import HTTPStatus
from typing import ClassVar, Literal, cast

from uvicorn._types import ASGI3Application, ASGIReceiveCallable, ASGISendCallable, Scope
from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from sidecar import config as config_mod
from sidecar.asgi import DISCONNECT_HUB, OVER_LIMIT, DisconnectHub
from sidecar.server.coalesce import CoalescingTransport
from sidecar.timers import LazyTimer
from sidecar.wire import error_body

log = logging.getLogger("sidecar.serve")


@dataclass(frozen=True, slots=True)
class ServerLimits:
    """The limits a server enforces on its clients (``Config`` fields of the same meaning)."""

    max_header_bytes: int = 64 * 1024
    header_timeout: float = 10.0
    body_timeout: float = 60.0
    concurrency: int = 0  # requests in flight; 0 = unlimited
    keep_alive: float = 5.0
    access_log: bool = False  # one uvicorn.access line per request

    @classmethod
    def of(cls, config: config_mod.Config, admin: bool = False) -> ServerLimits:
        """The proxy port's limits; the admin port has no concurrency limit (probes must answer)."""
        return cls(
            max_header_bytes=config.max_header_bytes,
            header_timeout=config.client_header_timeout,
            body_timeout=config.client_body_timeout,
            concurrency=0 if admin else config.limit_concurrency,
            keep_alive=config.timeout_keep_alive,
            access_log=config.access_log and not admin,  # probes every second are no one's news
        )


def _raw_error(status: int, type_: str, message: str) -> bytes:
    """A complete HTTP/1.1 error response in vLLM's shape that closes the connection."""
    body = error_body(message, status, type_)
    head = (
        f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\n"
        "content-type: application/json\r\n"
        f"content-length: {len(body)}\r\n"
        "connection: close\r\n\r\n"
    )
    return head.encode("ascii") + body


def _marked(app: ASGI3Application) -> ASGI3Application:
    """``app``, seeing the request marked as over the limit: it answers 503 itself (``Proxy``
    reads the body first, so P's blocks named in it are released)."""

    async def marked(scope: Scope, receive: ASGIReceiveCallable, send: ASGISendCallable) -> None:
        extensions: dict[str, object] = {**cast(dict[str, object], scope.get("extensions") or {})}
        extensions[OVER_LIMIT] = {}
        await app(cast(Scope, {**scope, "extensions": extensions}), receive, send)

    return marked


class _ClockedFlowControl(FlowControl):
    """uvicorn's flow control, telling the protocol when the server lets the client send again."""

    def __init__(self, transport: asyncio.Transport, protocol: GuardedProtocol) -> None:
        super().__init__(transport)
        self._protocol = protocol

    def resume_reading(self) -> None:
        if self.read_paused:
            self._protocol.reading_resumed()
        super().resume_reading()


class GuardedProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a header size limit, header and body timeouts and a
    concurrency limit that counts requests; ``limits`` is set by ``guarded_protocol``.

    Each connection is in one phase at a time, with its own clock: ``head`` from the
    connection's opening, or from the first byte after a response, until its header block is
    complete (``header_timeout``); ``body`` from then until the body is complete, measuring the
    gap since the latest read and not counted while the server itself holds reading back (flow
    control, ``Expect: 100-continue``; ``body_timeout``); ``idle`` once the answer is out and
    nothing else is due (``keep_alive``, which replaces uvicorn's own keep-alive timer); none
    while the application answers. One timer per connection serves them all: a phase only
    notes when its clock started, and the timer, when it fires, checks the phase then in force
    and either acts or sleeps again for what is left. So a busy keep-alive connection touches
    the event loop's timers about once per timeout, not several times per request.
    """

    limits: ClassVar[ServerLimits] = ServerLimits()

    _phase: Literal["head", "body", "idle"] | None = None
    _since = 0.0  # loop time the phase's clock started (the body's: the latest body bytes)
    _timer: LazyTimer
    _head_bytes = 0
    _head_began_mid_read = False  # the header block opened inside the current read
    _refused = False
    _hub: DisconnectHub

    transport: CoalescingTransport

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        # uvicorn writes a response's head and its body separately: one write when the body follows
        coalescing = CoalescingTransport(transport, self.loop)
        self._timer = LazyTimer(self.loop, self._expired)
        self._hub = DisconnectHub()
        super().connection_made(coalescing)
        self.access_log = self.limits.access_log  # uvicorn's own test: any handler up the tree
        self.flow = _ClockedFlowControl(coalescing, self)
        self._start_head()

    def connection_lost(self, exc: Exception | None) -> None:
        self._timer.stop()
        super().connection_lost(exc)
        self._hub.lost()

    def data_received(self, data: bytes) -> None:
        self._head_began_mid_read = False
        if self._phase == "idle":
            self._start_head()  # any byte between requests, even a stray CRLF, opens a header block
        super().data_received(data)
        if self.transport.is_closing():
            return
        if self._phase == "head":
            if self._head_began_mid_read:
                # A pipelined request's head began after the previous body in this same read:
                # only the next reads are all head (on_headers_complete still measures it exactly).
                # Some of it did arrive, though: a stall now is a 408, not an idle keep-alive.
                self._head_bytes = max(self._head_bytes, 1)
                return
            # Still incomplete: all of this read was head (llhttp keeps it until the block ends).
            self._head_bytes += len(data)
            if self._head_bytes > self.limits.max_header_bytes:
                self._refuse(431, "RequestHeaderFieldsTooLargeError", self._too_large())
        elif self._phase == "body":
            self._since = self.loop.time()

    def on_message_begin(self) -> None:
        if self._refused:
            return
        super().on_message_begin()
        self.scope[DISCONNECT_HUB] = self._hub  # type: ignore[literal-required]
        if self._phase != "head":
            self._start_head()
            self._head_began_mid_read = True

    def on_headers_complete(self) -> None:
        if self._refused:
            return
        size = len(self.url) + sum(len(name) + len(value) + 4 for name, value in self.headers)
        if size > self.limits.max_header_bytes:
            self._refuse(431, "RequestHeaderFieldsTooLargeError", self._too_large())
            return
        self._enter("body", self.limits.body_timeout)
        self.transport.hold_next()  # the response's head, until its body follows
        limit = self.limits.concurrency
        if not limit or len(self.tasks) < limit:
            super().on_headers_complete()
            return
        log.warning("concurrency limit reached, answering 503", extra={"limit": limit})
        app, self.app = self.app, _marked(self.app)
        try:
            super().on_headers_complete()
        finally:
            self.app = app

    def on_body(self, body: bytes) -> None:
        if not self._refused:
            super().on_body(body)

    def on_message_complete(self) -> None:
        if self._refused:
            return
        super().on_message_complete()
        cycle = self.cycle
        if cycle is not None and cycle.response_complete:  # answered before the body ended
            self._enter("idle", self.limits.keep_alive)
        else:
            self._phase = None  # the application answers: no clock on the client

    def on_response_complete(self) -> None:
        """uvicorn's, with the keep-alive clock on this connection's timer (uvicorn starts a
        timer per response)."""
        if self.pipeline or self.transport.is_closing():
            super().on_response_complete()  # the next request starts, or nothing is left to time
            return
        self.server_state.total_requests += 1
        self.flow.resume_reading()
        if self._phase is None:  # no later request has begun
            self._enter("idle", self.limits.keep_alive)

    def reading_resumed(self) -> None:
        """The server lets the client send again (``_ClockedFlowControl``)."""
        if self._phase == "body":
            # The client's gap starts now: bytes it sent while reading was held back arrive on
            # the next loop iteration, which may come after a body timer due this very instant.
            self._since = self.loop.time()

    def send_400_response(self, msg: str) -> None:
        if not self.transport.is_closing():  # not when a limit already answered
            super().send_400_response(msg)

    def _too_large(self) -> str:
        return f"request header block exceeds the limit of {self.limits.max_header_bytes} bytes"

    def _start_head(self) -> None:
        self._head_bytes = 0
        self._enter("head", self.limits.header_timeout)

    def _enter(self, phase: Literal["head", "body", "idle"], seconds: float) -> None:
        """Start ``phase``'s clock; the timer is moved only if it would fire after its limit."""
        now = self.loop.time()
        self._phase, self._since = phase, now
        self._timer.ensure(now + seconds)

    def _limit(self) -> float:
        """The current phase's limit in seconds (0: none)."""
        phase = self._phase
        if phase == "head":
            return self.limits.header_timeout
        if phase == "body":
            return self.limits.body_timeout
        return self.limits.keep_alive if phase == "idle" else 0.0

    def _expired(self) -> None:
        if self.transport.is_closing() or self.transport.get_protocol() is not self:
            return  # closed, or handed over (a WebSocket upgrade)
        limit = self._limit()
        if not limit:
            return  # the application is answering: the next phase arms the timer again
        deadline = self._since + limit
        if self.loop.time() < deadline:
            self._timer.ensure(deadline)  # the phase began after the timer was set: sleep on
        else:
            self._timed_out()

    def _timed_out(self) -> None:
        """The current phase's clock ran out."""
        cycle = self.cycle
        if self._phase == "body":
            if self.flow.read_paused or (cycle is not None and cycle.waiting_for_100_continue):
                self._enter("body", self.limits.body_timeout)  # the wait is the server's: the gap restarts
            else:
                self._refuse(408, "RequestTimeoutError", "request body not received in time")
        elif self._phase == "idle":
            self._refuse(0, "", "")  # an idle keep-alive connection: close quietly
        elif cycle is not None and not cycle.response_complete:
            self._enter("head", self.limits.header_timeout)  # a pipelined head waits for the answer before it
        elif self._head_bytes == 0:
            self._refuse(0, "", "")  # nothing sent: close quietly, as for an idle keep-alive
        else:
            self._refuse(408, "RequestTimeoutError", "request header block not received in time")

    def _refuse(self, status: int, type_: str, message: str) -> None:
        """Answer ``status`` unless the connection is answering something else, then close."""
        self._refused = True
        self._timer.stop()
        cycle = self.cycle
        if status and self._may_answer():
            log.warning("refused a client", extra={"status": status, "detail": message})
            self.transport.write(_raw_error(status, type_, message))
        if cycle is not None and not cycle.response_complete:
            cycle.disconnected = True  # the application sees http.disconnect; its sends are dropped
            cycle.message_event.set()
        self.transport.close()

    def _may_answer(self) -> bool:
        cycle = self.cycle
        if self._phase == "body":  # the current cycle is the late request's own
            return cycle is not None and not cycle.response_started
        # A head: the cycle, if any, is the previous request's; it must be answered in full.
        return cycle is None or cycle.response_complete


def guarded_protocol(limits: ServerLimits) -> type[GuardedProtocol]:
    """A ``GuardedProtocol`` class bound to ``limits`` (uvicorn instantiates it per connection)."""
    return type("GuardedProtocol", (GuardedProtocol,), {"limits": limits})


def server_options(limits: ServerLimits) -> dict[str, object]:
    """The uvicorn options that enforce ``limits`` (also used by the integration tests)."""
    return {
        "http": guarded_protocol(limits),
        "timeout_keep_alive": limits.keep_alive,
        "limit_concurrency": None,  # GuardedProtocol counts requests, not idle connections
    }
