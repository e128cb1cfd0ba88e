"""Every touch point between the sidecar and uvicorn's internals, in this module and ``cycle``.

The sidecar serves HTTP/1.1 with uvicorn's httptools protocol plus the
client limits uvicorn lacks (``docs/limits.md``):
``GuardedProtocol`` answers 431 over ``max_header_bytes``, 408 past
``client_header_timeout`` or ``client_body_timeout``, and marks a request
above ``limit_concurrency`` (``over_limit``: the proxy answers it 503 with
``connection: close``, after reading an inspected body to release it).

What it relies on, each checked against the installed uvicorn by
``tests/unit/test_uvicorn_internals.py``:

* private imports: ``uvicorn._types``; ``HttpToolsProtocol`` and
  ``FlowControl``, subclassed;
* ``HttpToolsProtocol`` methods overridden: ``connection_made``,
  ``connection_lost``, ``data_received``, ``on_message_begin``,
  ``on_headers_complete``, ``on_body``, ``on_message_complete``,
  ``on_response_complete``, ``send_400_response``, ``pause_writing``,
  ``resume_writing``; ``FlowControl.resume_reading``;
* its attributes: ``cycle``, ``scope``, ``url``, ``headers``, ``tasks``,
  ``pipeline``, ``app``, ``flow``, ``transport``, ``loop``; written:
  ``access_log``, ``server_state.total_requests``;
* ``RequestResponseCycle`` (``sidecar.server.cycle.UvicornCycle`` reads it for the relay):
  ``transport``, ``chunked_encoding``, ``response_started``,
  ``response_complete``, ``disconnected``, ``flow.write_paused``,
  ``waiting_for_100_continue``; written when a limit closes the connection:
  ``disconnected``, ``message_event``; read and written to end a whole answer as
  ``send`` ends one (``UvicornCycle.answer``, checked against uvicorn's own bytes
  and ending by ``tests/unit/test_whole_answer.py``): ``access_log``,
  ``default_headers``, ``keep_alive``, ``scope``, ``expected_content_length``,
  ``on_response``, and the module's ``STATUS_LINE``;
* ``uvicorn.Server.capture_signals`` and ``startup`` overridden (``Server``, its sockets read by
  ``sidecar.server.accept``); ``uvicorn.Config.load()`` called and ``ssl`` replaced (``serve_tls``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import socket
from collections.abc import Generator
from typing import TYPE_CHECKING, Any, ClassVar, Literal, cast

import uvicorn
from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from sidecar.asgi import DISCONNECT_HUB, DisconnectHub
from sidecar.server.accept import Acceptor
from sidecar.server.cycle import UvicornCycle
from sidecar.server.limits import ServerLimits, marked_over_limit, raw_error
from sidecar.server.memory import settle_heap
from sidecar.transport.coalesce import CoalescingTransport
from sidecar.transport.relay import RELAY, ClientRelay
from sidecar.transport.timers import LazyTimer

if TYPE_CHECKING:
    from sidecar.tls.server import ServerTLS

log = logging.getLogger("sidecar.serve")


class _ClockedFlowControl(FlowControl):
    """uvicorn's flow control, telling the protocol when the server lets the client send again."""

    def __init__(self, transport: asyncio.Transport, protocol: GuardedProtocol) -> None:
        super().__init__(transport)
        self._protocol = protocol

    def resume_reading(self) -> None:
        if self.read_paused:  # uvicorn's does nothing otherwise (called twice per request)
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
    _read_bytes = 0  # the size of the current read
    _began_in_read = False  # the current request's message began inside the current read
    _refused = False
    _hub: DisconnectHub
    _relay: ClientRelay | None = None  # the response whose body D's connection writes to us

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
        self._head_began_mid_read = self._began_in_read = False
        self._read_bytes = len(data)
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
        self._began_in_read = True
        self.scope[DISCONNECT_HUB] = self._hub  # type: ignore[literal-required]
        if self._phase != "head":
            self._start_head()
            self._head_began_mid_read = True

    def on_headers_complete(self) -> None:
        if self._refused:
            return
        limit = self.limits.max_header_bytes
        # A block that began and ended inside one read no larger than the limit is within it.
        if not (self._began_in_read and self._read_bytes <= limit) and (
            len(self.url) + sum(len(name) + len(value) + 4 for name, value in self.headers) > limit
        ):
            self._refuse(431, "RequestHeaderFieldsTooLargeError", self._too_large())
            return
        self._enter("body", self.limits.body_timeout)
        self.transport.hold_next()  # the response's head, until its body follows
        limit = self.limits.concurrency
        if not limit or len(self.tasks) < limit:
            super().on_headers_complete()
            self._offer_relay()
            return
        log.warning("concurrency limit reached, answering 503", extra={"limit": limit})
        app, self.app = self.app, marked_over_limit(self.app)
        try:
            super().on_headers_complete()
        finally:
            self.app = app

    def _offer_relay(self) -> None:
        """The new request's cycle may have its body relayed from D (``sidecar.transport.relay``)."""
        cycle = self.cycle
        if cycle is not None and cycle.scope is self.scope:  # not an upgrade
            self.scope[RELAY] = ClientRelay(self, UvicornCycle(cycle))  # type: ignore[literal-required]

    def relaying(self, relay: ClientRelay | None) -> None:
        """``relay`` now writes to this connection (None: no longer); it hears about back-pressure."""
        self._relay = relay

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._relay is not None:
            self._relay.pause()

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._relay is not None:
            self._relay.resume()

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
            self.transport.write(raw_error(status, type_, message))
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


class Server(uvicorn.Server):
    """A uvicorn server whose signals and start-up failure are handled by ``serve``, not by itself.

    With ``freeze``, once started (the lifespan included) it moves every object then alive out of
    the cyclic garbage collector's sight (``gc.freeze``): what start-up built (modules, the app,
    its clients) lives as long as the process, and the collector's full passes no longer walk it
    (``sidecar.server.memory.settle_heap``).
    """

    startup_failed = False

    def __init__(self, config: uvicorn.Config, freeze: bool = False) -> None:
        super().__init__(config)
        self._freeze = freeze

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await self.lifespan.startup()
        if self.lifespan.should_exit:  # uvicorn would end the process: stop this server only
            self.startup_failed = self.should_exit = True
            return
        config, state, kind = self.config, self.server_state, cast(Any, self.config.http_protocol_class)
        protocol = functools.partial(kind, config=config, server_state=state, app_state=self.lifespan.state)
        self.servers = [Acceptor(s, protocol, config.ssl) for s in sockets or ()]  # type: ignore[misc]
        self.started = True
        if self._freeze and not self.should_exit:
            settle_heap()


def uvicorn_config(
    app: object, host: str, port: int, limits: ServerLimits, **extra: object
) -> uvicorn.Config:
    """One server's uvicorn settings: httptools behind ``GuardedProtocol``, no uvicorn logging."""
    options: dict[str, object] = {
        "host": host,
        "port": port,
        "loop": "none",
        "log_config": None,
        # True keeps uvicorn from cutting uvicorn.access off for every server in the process
        # (Config.configure_logging); each protocol says whether it logs (ServerLimits.access_log).
        "access_log": True,
        "server_header": False,  # D's own Server/Date headers pass through
        "date_header": False,
        "proxy_headers": False,  # the sidecar never reads the client address
        **server_options(limits),
        **extra,
    }
    return uvicorn.Config(app, **options)  # type: ignore[arg-type]


def serve_tls(uv: uvicorn.Config, tls: ServerTLS | None) -> None:
    """Serve ``uv`` with ``tls``'s context: uvicorn builds one only from file names, so the
    config is loaded here and its context replaced (the server then does not load it again)."""
    if tls is not None:
        uv.load()
        uv.ssl = tls.context
