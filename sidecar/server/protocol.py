"""The sidecar's HTTP/1.1 server: one client connection, parsed by llhttp (``httptools``).

As ``sidecar.upstream`` owns the client side, this module owns the server side:
llhttp parses every request (target, headers, ``Content-Length`` and chunked
framing, keep-alive) and refuses what is not HTTP/1.1; around it (``docs/limits.md``):

* limits: 431 over ``max_header_bytes``, 408 past ``client_header_timeout`` or
  ``client_body_timeout``, a quiet close past ``timeout_keep_alive``, and a request
  above ``limit_concurrency`` marked ``over_limit`` (the proxy answers it 503 and
  closes, after reading an inspected body to release it); vLLM's error shape.
* keep-alive and pipelining: answers go in order, one application task at a time;
  a request that arrives meanwhile waits its turn with reading paused.
  ``Connection: close`` (or HTTP/1.0 without keep-alive) ends the connection
  after its answer; bytes sent after such a request are read and dropped.
* malformed input: what llhttp refuses (conflicting or repeated
  ``Content-Length``, one beside ``Transfer-Encoding``, obs-fold, a bare CR, a bad
  chunk size, control characters) is answered 400 once the answers owed before
  it are out, then the connection closes. ``Upgrade`` and ``CONNECT`` are
  answered as plain HTTP and end the connection (400 if they declare a body:
  llhttp stops reading at their head).
* a half-close (the client shuts its sending side) is the client leaving, as
  nginx and uvicorn take it.

Each request is a ``Cycle`` (``sidecar.server.cycle``); its scope carries the
connection's ``DisconnectHub`` and a ``ClientRelay`` (``sidecar.transport.relay``).
No ``Server`` or ``Date`` header is added: D's own pass through. uvicorn makes
this protocol per connection as any protocol class (``sidecar.server.host``);
of its server state, the connections and tasks its shutdown waits on, and the
request count.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from typing import Any, ClassVar, Protocol, cast

import httptools

from sidecar.asgi import DISCONNECT_HUB, DisconnectHub
from sidecar.server.clock import ClientClock, Phase
from sidecar.server.cycle import HIGH_WATER, Cycle, Endpoints, request_scope
from sidecar.server.limits import ASGIApp, ServerLimits, marked_over_limit, raw_error
from sidecar.transport.relay import RELAY, ClientRelay

log = logging.getLogger("sidecar.serve")


class ServerState(Protocol):
    """What the server shares with every connection (uvicorn's ``Server.server_state``)."""

    connections: set[Any]  # the open connections: shutdown asks each to close, then waits for them
    tasks: set[asyncio.Task[None]]  # the applications running: shutdown waits for them, then cancels
    total_requests: int


class LoadedConfig(Protocol):
    """The server's config, as a protocol class is given it (``uvicorn.Config``, loaded)."""

    loaded_app: ASGIApp


class GuardedProtocol(asyncio.Protocol):
    """One client connection (see the module docstring); ``limits`` is set by ``guarded_protocol``.
    The client's clock (``sidecar.server.clock``) times its header block, its body and its idle
    keep-alive."""

    limits: ClassVar[ServerLimits] = ServerLimits()

    __slots__ = (
        "_began_in_read", "_clock", "_drainer", "_ends", "_head_began_mid_read", "_headers", "_hub",
        "_ignoring", "_owed", "_parser", "_pipeline", "_read_bytes", "_read_paused", "_refusal",
        "_refused", "_relay", "_running", "_url", "app", "app_state", "cycle", "logs_access", "loop",
        "state", "transport", "write_paused",
    )  # fmt: skip

    def __init__(
        self,
        config: LoadedConfig,
        server_state: ServerState,
        app_state: dict[str, Any],
        loop: asyncio.AbstractEventLoop | None = None,
        **_: object,  # uvicorn also names the loop it runs in: the running loop is that one
    ) -> None:
        self.app, self.state, self.app_state = config.loaded_app, server_state, app_state
        self.loop = loop or asyncio.get_running_loop()
        self.logs_access = self.limits.access_log
        self._parser = httptools.HttpRequestParser(self)
        self._url = b""
        self._headers: list[tuple[bytes, bytes]] = []
        self.cycle: Cycle | None = None  # the latest request parsed
        self._running: Cycle | None = None  # the request whose application runs (or last ran)
        self._pipeline: deque[tuple[Cycle, ASGIApp]] = deque()  # parsed, waiting for their turn
        self._relay: ClientRelay | None = None  # the response whose body D's connection writes to us
        self._read_paused = self.write_paused = False
        self._drainer: asyncio.Future[None] | None = None
        self._clock = ClientClock(self.loop, self.limits, self._timed_out)
        self._head_began_mid_read = False  # the header block opened inside the current read
        self._read_bytes, self._began_in_read = 0, False  # the current read: its size, a message began
        self._refused = False  # a limit or malformed input ended the connection: nothing more is parsed
        self._refusal: bytes = b""  # the refusal written once the answers owed before it are out
        self._ignoring = False  # bytes that arrive are dropped (after Connection: close, an upgrade)
        self._owed = 0  # requests parsed and not yet answered
        self._hub = DisconnectHub()
        self._ends = Endpoints(None, None, "http")
        self.transport: asyncio.Transport

    # -- asyncio.Protocol ---------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's do not subclass asyncio's
        self.state.connections.add(self)
        self._ends = Endpoints.of(transport)
        self._clock.start_head()

    def connection_lost(self, exc: Exception | None) -> None:
        self.state.connections.discard(self)
        self._clock.stop()
        for cycle in (self._running, self.cycle, *(c for c, _ in self._pipeline)):
            if cycle is not None:
                cycle.lost()
        self._pipeline.clear()
        self._hub.lost()
        self.write_paused = False
        self._wake_drainer()

    def eof_received(self) -> None:
        """A half-close: the client left, as nginx (499, nothing sent) and uvicorn take it."""

    def data_received(self, data: bytes) -> None:
        if self._ignoring:
            return
        self._head_began_mid_read = self._began_in_read = False
        self._read_bytes = len(data)
        clock = self._clock
        if clock.phase == "idle":
            clock.start_head()  # any byte between requests, even a stray CRLF, opens a header block
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._ignoring = True  # what follows the head is another protocol's
            return
        except httptools.HttpParserCallbackError as exc:  # a fault of this module's, not the client's
            log.error("request parsing failed", exc_info=exc.__context__ or exc)
            if not (self._ignoring or self._refused):
                self._refuse(400, "BadRequestError", "invalid HTTP request")
            return
        except httptools.HttpParserError as exc:
            if not (self._ignoring or self._refused):  # else: bytes after a request that ends it
                self._refuse(400, "BadRequestError", f"invalid HTTP request: {_reason(exc)}")
            return
        if self._refused or self._ignoring:
            return
        if clock.phase == "head":
            if self._head_began_mid_read:
                # A pipelined request's head began after the previous body in this same read:
                # only the next reads are all head (on_headers_complete still measures it exactly).
                # Some of it did arrive, though: a stall now is a 408, not an idle keep-alive.
                clock.head_bytes = max(clock.head_bytes, 1)
            else:
                # Still incomplete: all of this read was head (llhttp keeps it until the block ends).
                clock.head_bytes += len(data)
                if clock.head_bytes > self.limits.max_header_bytes:
                    self._refuse(431, "RequestHeaderFieldsTooLargeError", self._too_large())
                    return
        elif clock.phase == "body":
            clock.touch()
        if self._pipeline:
            self._pause_reading()  # a request waits for its turn: read no further for now

    def pause_writing(self) -> None:
        self.write_paused = True
        if self._relay is not None:
            self._relay.pause()

    def resume_writing(self) -> None:
        self.write_paused = False
        self._wake_drainer()
        if self._relay is not None:
            self._relay.resume()

    # -- llhttp's callbacks -----------------------------------------------------------------------

    def on_message_begin(self) -> None:
        if self._refused:
            return
        self._url, self._headers = b"", []
        self._began_in_read = True
        if self._clock.phase != "head":
            self._clock.start_head()
            self._head_began_mid_read = True

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        # llhttp keeps a value's trailing white space, which RFC 9110 (5.5) excludes from it
        self._headers.append((name.lower(), value.rstrip(b" \t")))

    def on_headers_complete(self) -> None:
        if self._refused:
            return
        limit, headers = self.limits.max_header_bytes, self._headers
        # A block that began and ended inside one read no larger than the limit is within it.
        if not (self._began_in_read and self._read_bytes <= limit) and (
            len(self._url) + sum(len(name) + len(value) + 4 for name, value in headers) > limit
        ):
            self._refuse(431, "RequestHeaderFieldsTooLargeError", self._too_large())
            return
        parser = self._parser
        version = parser.get_http_version()
        keep_alive = version != "1.0" and parser.should_keep_alive()
        upgrade = parser.should_upgrade()
        if upgrade:
            if any(name in (b"content-length", b"transfer-encoding") and value not in (b"", b"0")
                   for name, value in headers):  # fmt: skip
                self._refuse(
                    400, "BadRequestError", "a request that asks to switch protocols has no body here"
                )
                return
            keep_alive = False  # answered as plain HTTP; what follows its head is not read
        try:
            url = httptools.parse_url(self._url)
            method = parser.get_method().decode("ascii")
            scope = request_scope(method, version, url, headers, self._ends, self.app_state)
        except (httptools.HttpParserInvalidURLError, UnicodeDecodeError):
            self._refuse(400, "BadRequestError", "invalid HTTP request: the request target")
            return
        expect = any(n == b"expect" and v.lower() == b"100-continue" for n, v in headers)
        cycle = self.cycle = Cycle(self, scope, keep_alive, expect)
        scope[DISCONNECT_HUB] = self._hub
        scope[RELAY] = ClientRelay(self, cycle)
        self._clock.enter("body")
        app, concurrency = self.app, self.limits.concurrency
        if concurrency and len(self.state.tasks) >= concurrency:
            log.warning("concurrency limit reached, answering 503", extra={"limit": concurrency})
            app = marked_over_limit(app)
        self._owed += 1
        if self._running is None or self._running.response_complete:
            self._start(cycle, app)
        else:  # pipelined: answered after the ones before it
            self._pipeline.append((cycle, app))

    def on_body(self, body: bytes) -> None:
        cycle = self.cycle
        if self._refused or cycle is None or cycle.response_complete:
            return
        cycle.body += body
        if len(cycle.body) > HIGH_WATER:
            self._pause_reading()
        cycle.wake()

    def on_message_complete(self) -> None:
        cycle = self.cycle
        if self._refused or cycle is None:
            return
        cycle.more_body = False
        cycle.wake()
        if not cycle.keep_alive:
            self._ignoring = True  # the connection ends with this request's answer
            self._clock.stop()
        elif cycle.response_complete:  # answered before the body ended
            self._clock.enter("idle")
        else:
            self._clock.answering()

    # -- requests and responses ---------------------------------------------------------------

    def _start(self, cycle: Cycle, app: ASGIApp) -> None:
        self._running = cycle
        task = self.loop.create_task(cycle.run(app))
        task.add_done_callback(self.state.tasks.discard)
        self.state.tasks.add(task)

    def response_done(self, cycle: Cycle) -> None:
        """``cycle``'s response is complete (``Cycle``): the next request's turn, or the keep-alive clock."""
        self.state.total_requests += 1
        self._owed -= 1
        if self.transport.is_closing():
            return
        if self._pipeline:
            self._start(*self._pipeline.popleft())
        elif self._refused:  # a refusal waited for this answer
            self._close_refused()
            return
        self._resume_reading()
        if self._clock.phase is None and not self._owed and not self._ignoring:
            self._clock.enter("idle")

    def body_taken(self) -> None:
        """The application took the request body so far (``Cycle.receive``): let the client send."""
        cycle = self.cycle
        if self._read_paused and not self._pipeline and (cycle is None or len(cycle.body) <= HIGH_WATER):
            self._resume_reading()

    async def drain(self) -> None:
        """Until the client's transport is below its high-water mark again (or the client left)."""
        while self.write_paused:
            if self._drainer is None:
                self._drainer = self.loop.create_future()
            await self._drainer

    def relaying(self, relay: ClientRelay | None) -> None:
        """``relay`` now writes to this connection (None: no longer); it hears about back-pressure."""
        self._relay = relay

    def shutdown(self) -> None:
        """The server is stopping (uvicorn's graceful shutdown): close now if nothing is being
        answered, else once the answer in progress is out; requests waiting their turn are dropped."""
        self._ignoring, waiting, self._pipeline = True, self._pipeline, deque()
        self._owed -= len(waiting)
        for cycle, _ in waiting:
            cycle.lost()
        running = self._running
        if running is None or running.response_complete:
            self.transport.close()
        else:
            running.keep_alive = False

    def _wake_drainer(self) -> None:
        drainer, self._drainer = self._drainer, None
        if drainer is not None and not drainer.done():
            drainer.set_result(None)

    def _pause_reading(self) -> None:
        if not self._read_paused:
            self._read_paused = True
            self.transport.pause_reading()

    def _resume_reading(self) -> None:
        if self._read_paused and not self.transport.is_closing():
            self._read_paused = False
            self.transport.resume_reading()
            if self._clock.phase == "body":
                # The client's gap starts now: bytes it sent while reading was held back arrive on
                # the next loop iteration, which may come after a body timer due this very instant.
                self._clock.touch()

    # -- limits -----------------------------------------------------------------------------------

    def _too_large(self) -> str:
        return f"request header block exceeds the limit of {self.limits.max_header_bytes} bytes"

    def _timed_out(self, phase: Phase) -> None:
        """``phase``'s clock ran out (``ClientClock``)."""
        if self.transport.is_closing() or self._refused:
            return
        cycle = self.cycle
        if phase == "body":
            if self._read_paused or (cycle is not None and cycle.waiting_for_100_continue):
                self._clock.enter("body")  # the wait is the server's: the client's gap restarts
            else:
                self._refuse(408, "RequestTimeoutError", "request body not received in time")
        elif phase == "idle" or self._clock.head_bytes == 0:
            self._refuse(0, "", "")  # an idle keep-alive connection, or nothing sent: close quietly
        else:
            self._refuse(408, "RequestTimeoutError", "request header block not received in time")

    def _refuse(self, status: int, type_: str, message: str) -> None:
        """End the connection: nothing more is read; ``status`` (0: none) is answered once every
        answer owed before it is out, then the connection closes. A refusal in the body phase is
        the latest request's own: its application sees the client gone (its sends are dropped),
        and ``status`` is its answer if its response had not started."""
        self._refused = self._ignoring = True
        own = self.cycle if self._clock.phase == "body" else None
        self._clock.stop()
        answerable = status != 0
        if own is not None:
            answerable = answerable and not own.response_started
            if not own.response_complete:  # running, or waiting its turn
                own.lost()
                self._owed -= 1  # its own answer is this refusal, or none
                self._pipeline = deque((c, a) for c, a in self._pipeline if c is not own)
        if answerable:
            log.warning("refused a client", extra={"status": status, "detail": message})
            self._refusal = raw_error(status, type_, message)
        if self._owed > 0:  # answers to earlier requests are still being written: after them
            self._pause_reading()
            return
        self._close_refused()

    def _close_refused(self) -> None:
        refusal, self._refusal = self._refusal, b""
        if refusal and not self.transport.is_closing():
            self.transport.write(refusal)
        self.transport.close()


def _reason(exc: httptools.HttpParserError) -> str:
    """llhttp's reason for refusing a request, as it words it (a fixed text, never the input)."""
    return (str(exc.args[0]) if exc.args else "").strip() or "malformed request"


def guarded_protocol(limits: ServerLimits) -> type[GuardedProtocol]:
    """A ``GuardedProtocol`` class bound to ``limits`` (the server instantiates it per connection)."""
    return type("GuardedProtocol", (GuardedProtocol,), {"limits": limits, "__slots__": ()})
