"""The proxy's handler: one request, from the ASGI call to D's answer and the client's.

Every method and path goes to D unchanged (``Forwarder.passthrough``). For
``POST`` on an inspected route the body is read once under the cap
(``sidecar.proxy.context.read_body``) and the request takes router mode's
path when it applies (``RouterMode``), else the sidecar's: its parameters are
checked into an ``Exchange`` (``sidecar.proxy.context.Inspector``), refused if
they were already released, then admitted (``Proxy.admit``): refused while
the sidecar drains, an injected rejection (``Injector``), else forwarded to D
and judged (``Forwarder``).

The sidecar's own answers, D never seeing the request; each judges the
exchange before answering, so a release's ``x-should-retry`` reaches the
client:

* a replay: parameters already handed to a release (P may reuse the blocks:
  D reading them would decode from another request's cache), 409 (410, then
  400, when a proxy in front retries 409: ``sidecar.retries``);
* an injected rejection for load tests (``Injector``);
* the sidecar shutting down (503);
* a body over ``max_body_bytes`` (413), released when its parameters can be
  found and trusted;
* above ``limit_concurrency`` (503, connection shed), the body read first, at
  most ``max(8, limit / 4)`` at once, so its blocks are released (unread when
  a proxy in front retries 503: nothing is released behind it).

``Forwarder`` is the bytes' path to D and back: an error answer (read whole, up
to ``ERROR_BODY_LIMIT``) is judged before its head goes out, so the judge's
headers can join it; a 200 is pumped as raw bytes, a stream judged from its
first event as it passes (``sidecar.decision.judge.StreamJudge``), a
router-mode JSON answer corrected (``cached_tokens``) first. A failure before
any answer is judged and answered in the style picked at start
(``sidecar.proxy.answers``). ``passthrough`` forwards everything else
unchanged, request body streamed. A client that disconnects cancels the
exchange and closes the upstream response, so D sees the abort.

Router mode reaches the proxy through ``Proxy``'s admission step alone
(``admit``, ``alone``, ``prefilled``, ``abandoned``, ``unsent``, as
``sidecar.router.legs.Admission`` names them); the app builds router mode on
it (``ProxyParts.routing``) and the proxy sees it as ``RouterMode``, so the
request path never imports router mode.

This is a plain ASGI callable rather than a Starlette route: the catch-all
needs no routing, and skipping the framework's request objects keeps the
proxy's CPU per request low.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

import msgspec

from sidecar import retries
from sidecar.asgi import DISCONNECT_HUB, Receive, Scope, Send, over_limit
from sidecar.classify import FAILURE_STATUS, Event, NoAnswer
from sidecar.config import INSPECTED_ROUTES, Config
from sidecar.decision.judge import DecodeWatch, InFlight, Judge, StreamJudge
from sidecar.decision.policy import SIDECAR, Policy
from sidecar.observability.metrics import ROUTES, Metrics, status_class
from sidecar.observability.tracing import OFF, Leg, Tracing
from sidecar.proxy.answers import CLOSE, INJECTED, NO_RETRY, STYLES, VLLM, AnswerStyle, send_error
from sidecar.proxy.context import (
    INJECT_HEADER,
    ClientGone,
    Exchange,
    Inspector,
    Oversized,
    RequestContext,
    read_body,
)
from sidecar.proxy.disconnect import DisconnectWatcher, client_gone, uncancel
from sidecar.proxy.headers import response_head, response_headers
from sidecar.proxy.trust import Trust
from sidecar.proxy.usage import UsageRewriter
from sidecar.release.pipeline import Pipeline
from sidecar.transport.relay import RELAY, ClientRelay
from sidecar.upstream import Client, Response, Sent, UpstreamError
from sidecar.wire import ANTHROPIC_ERROR_DECODER, ERROR_DECODER

log = logging.getLogger("sidecar.proxy")

SHUTTING_DOWN = "the sidecar is shutting down"
REPLAY_MESSAGE = (
    "kv_transfer_params were released to the prefill server after an earlier rejection of a "
    "request with them; run the prefill again"
)
ERROR_BODY_LIMIT = 64 * 1024
REWRITE_LIMIT = 16 * 1024 * 1024
WHOLE_LIMIT = 64 * 1024  # a JSON answer up to this size is read whole, then written at once
Head = list[tuple[bytes, bytes]]


class RouterMode(Protocol):
    """Router mode as the proxy sees it (``sidecar.router.legs.Router``)."""

    policy: Policy  # router mode's, picked once

    def routes(self, ctx: RequestContext) -> bool:
        """Whether this request takes the router's path."""

    async def route(self, ctx: RequestContext, body: bytes) -> None:
        """Run the prefill leg, then the decode leg, and answer the client."""

    async def close(self) -> None:
        """Release what router mode holds (its connections to P)."""


@dataclass
class ProxyParts:
    """What the proxy works with; the app builds them from the config (tests inject fakes)."""

    upstream: Client
    pipeline: Pipeline
    metrics: Metrics
    trust: Trust
    inflight: InFlight
    injector: Injector
    decode: DecodeWatch
    routing: Callable[[Proxy], RouterMode] | None = None  # router mode, built on the proxy's admission step
    tracing: Tracing = OFF


class Proxy:
    """The proxy's ASGI handler for ``http`` scopes (see the module docstring)."""

    def __init__(self, config: Config, parts: ProxyParts) -> None:
        self.config, self.metrics, self.tracing = config, parts.metrics, parts.tracing
        self.pipeline, self._injector = parts.pipeline, parts.injector
        judge = Judge(config, parts.pipeline, parts.metrics, parts.inflight, parts.decode, parts.tracing)
        self._inspector = Inspector(parts.metrics, parts.trust, parts.pipeline.releaser.keeps_raw)
        answers = STYLES[config.answers]  # the style of the sidecar's own answers, picked once
        self._forwarder = Forwarder(parts.upstream, judge, parts.metrics, parts.tracing, answers)
        self._release_frees = judge.release_frees
        self._scan_limit = config.max_body_bytes * 4
        # Bodies read at once for requests above limit_concurrency (to release what they name);
        # past this many, such requests are refused unread and P's lease frees their blocks.
        self._over_limit_cap = max(8, config.limit_concurrency // 4)
        self._over_limit_reads = 0
        # The spent-parameters answer is one no proxy in front retries on another pod.
        self._replay_status = retries.replay_status(judge.retried)
        self._over_limit_unread = FAILURE_STATUS[NoAnswer.OVERLOADED] in judge.retried
        self.stopping = False  # set once the drain began: new inspected requests are refused and released
        self.router = parts.routing(self) if parts.routing is not None else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        ctx = RequestContext.of(scope, receive, send)
        tracing, metrics = self.tracing, self.metrics
        metrics.requests_in_flight += 1
        try:
            if ctx.route is not None and tracing.enabled:
                with tracing.server_span(scope) as span:
                    ctx.send = span.watch(send)
                    await self._handle(ctx)
            else:
                await self._handle(ctx)
        except asyncio.CancelledError:
            # uvicorn cancels what still runs past drain_timeout at shutdown (a client's own
            # disconnect is handled where it happens). Answer in vLLM's shape if nothing was
            # sent yet, instead of uvicorn's plain-text 500 and a logged traceback.
            uncancel()
            await _answer_if_unanswered(send, 503, SHUTTING_DOWN, ctx.request_id)
        finally:
            metrics.requests_in_flight -= 1
            # The relay holds the server's cycle, which holds this scope: dropped, the request's
            # objects are freed as it ends rather than left to the garbage collector as a cycle.
            scope.pop(RELAY, None)

    async def _handle(self, ctx: RequestContext) -> None:
        router = self.router if self.router is not None and self.router.routes(ctx) else None
        policy = router.policy if router is not None else SIDECAR  # the mode of this request
        if over_limit(ctx.scope):
            await self._over_limit(ctx, policy)
            return
        if ctx.route is None:
            await self._forwarder.passthrough(ctx)
            return
        try:
            body = await read_body(ctx.receive, self.config.max_body_bytes, self._scan_limit)
        except ClientGone:
            # Without the whole body there are no trustworthy parameters to release.
            self.metrics.answered(ctx.route, -1)
            return
        if isinstance(body, Oversized):
            await self._too_large(ctx, body, policy)
        elif router is not None:
            await router.route(ctx, body)
        else:
            await self._inspected(ctx, body)

    async def _inspected(self, ctx: RequestContext, body: bytes) -> None:
        """Sidecar mode: the client's own parameters, checked, then the request to D."""
        exchange = self._inspector.inspected(ctx, body)
        spent = exchange.params is not None and self.pipeline.holds(exchange.key)
        if spent and await self._replay(ctx, exchange):
            return
        await self.admit(ctx, exchange, ctx.headers, body)

    # --- the admission step: the sidecar's path, and router mode's way in ------------------

    async def admit(
        self,
        ctx: RequestContext,
        exchange: Exchange,
        headers: list[tuple[str, str]],
        body: bytes,
        watcher: DisconnectWatcher | None = None,
    ) -> None:
        """Refused while draining, an injected rejection, else to D: answered and judged."""
        if self.stopping:
            if watcher is not None:
                watcher.stop()
            await self._refuse(ctx, exchange, NoAnswer.SHUTTING_DOWN, SHUTTING_DOWN)
            return
        injector = self._injector
        if injector.enabled:
            assert ctx.route is not None
            status = injector.status_for(ctx.route, ctx.headers_read, exchange.params is not None)
            if status is not None:
                if watcher is not None:
                    watcher.stop()
                await self._injected(ctx, exchange, status)
                return
        await self._forwarder.forward(ctx, exchange, headers, body, watcher)

    async def alone(
        self, ctx: RequestContext, stream: bool, headers: list[tuple[str, str]], body: bytes
    ) -> None:
        """To D without parameters (D prefills itself, or answers a body that is no JSON object)."""
        await self._forwarder.forward(ctx, self._inspector.plain(ctx, stream), headers, body)

    def prefilled(
        self,
        ctx: RequestContext,
        raw: bytes | None,
        rewriter: UsageRewriter | None,
        policy: Policy,
        answered: float | None,
    ) -> Exchange:
        """Router mode: the decode leg's exchange, with P's own parameters as JSON (``raw``,
        ``Inspector.prefilled``)."""
        return self._inspector.prefilled(ctx, raw, rewriter, policy, answered)

    def abandoned(self, exchange: Exchange) -> None:
        """The client left before the request went to D: released, counted as gone."""
        self._forwarder.judged(exchange, Event(failure=NoAnswer.CLIENT_GONE_BEFORE_FORWARD))
        self.metrics.answered(exchange.route, -1)

    def unsent(self, exchange: Exchange) -> None:
        """P's answer was over ``prefill_answer_limit``: no decode leg goes to D, so it is released."""
        self._forwarder.judged(exchange, Event(failure=NoAnswer.PREFILL_ANSWER_TOO_LARGE))

    # --- the sidecar's own answers (see the module docstring) --------------------------------

    async def _replay(self, ctx: RequestContext, exchange: Exchange) -> bool:
        """A request naming parameters already released: refused when P frees them.

        The parameters are single-use after a rejection (as with vLLM's own release, 0.21.0+),
        and the caller must prefill again. With a strategy that frees nothing (``off``,
        ``dry-run``) the request is forwarded and only counted. True when answered here.
        """
        if not self._release_frees:
            self.metrics.replays.labels("forwarded").inc()
            log.warning(
                "request reuses parameters of a released request (forwarded: the strategy frees nothing)",
                extra={"request_id": exchange.request_id},
            )
            return False
        status = self._replay_status
        self.metrics.replays.labels("refused").inc()
        self.metrics.answered(exchange.route, status)
        log.warning(
            "request reuses parameters already released to P; refused",
            extra={"request_id": exchange.request_id},
        )
        await send_error(
            ctx.send, status, REPLAY_MESSAGE, exchange.request_id, "kv_transfer_params", (NO_RETRY,)
        )
        return True

    async def _injected(self, ctx: RequestContext, exchange: Exchange, status: int) -> None:
        """Answer an injected rejection; D never sees the request (``Injector``)."""
        self._forwarder.judged(exchange, Event(failure=NoAnswer.INJECTED, answer=status))
        self.metrics.injected.labels(status_class(status)).inc()
        self.metrics.answered(exchange.route, status)
        message = "rejection injected by kv-release-sidecar (load test)"
        extra = (INJECTED, *exchange.retry_headers())
        await send_error(ctx.send, status, message, exchange.request_id, extra=extra)

    async def _refuse(
        self, ctx: RequestContext, exchange: Exchange, failure: NoAnswer, message: str, close: bool = False
    ) -> None:
        """The sidecar answers itself; D never sees the request."""
        self._forwarder.judged(exchange, Event(failure=failure))
        status = FAILURE_STATUS[failure]
        self.metrics.answered(exchange.route, status)
        extra = (*exchange.retry_headers(), *((CLOSE,) if close else ()))
        await send_error(ctx.send, status, message, exchange.request_id, extra=extra)

    async def _too_large(self, ctx: RequestContext, body: Oversized, policy: Policy) -> None:
        exchange = self._inspector.oversized(ctx, body, policy)
        # The size the client declared; without one, what was read (all of it, or a lower bound).
        if ctx.declared is not None:
            size = f"{ctx.declared} bytes"
        else:
            size = f"{body.size} bytes" if body.complete else f"more than {body.size} bytes"
        message = f"request body of {size} exceeds the limit of {self.config.max_body_bytes}"
        # Past scan_limit the rest of the body is unread: shed the connection rather than have the
        # server read and discard an unbounded remainder outside limit_concurrency.
        await self._refuse(ctx, exchange, NoAnswer.BODY_TOO_LARGE, message, close=not body.complete)

    async def _over_limit(self, ctx: RequestContext, policy: Policy) -> None:
        """Above ``limit_concurrency``: 503 and the connection shed (see the module docstring).

        A passthrough request, a router-mode request (no prefill ran yet; client parameters are
        dropped there) and any past the cap are refused unread.
        """
        message = "the sidecar is at its concurrency limit"
        unread = (
            not policy.client_params
            or self._over_limit_unread
            or self._over_limit_reads >= self._over_limit_cap
        )
        if ctx.route is None or unread:
            if ctx.route is not None:
                self.metrics.answered(ctx.route, 503)
            await send_error(ctx.send, 503, message, ctx.request_id, extra=(CLOSE,))
            return
        self._over_limit_reads += 1
        try:
            body = await read_body(ctx.receive, self.config.max_body_bytes, self._scan_limit)
        except ClientGone:
            self.metrics.answered(ctx.route, -1)
            return
        finally:
            self._over_limit_reads -= 1
        if isinstance(body, Oversized):
            await self._too_large(ctx, body, policy)
            return
        exchange = self._inspector.inspected(ctx, body)
        await self._refuse(ctx, exchange, NoAnswer.OVERLOADED, message, close=True)


class Injector:
    """Decides, per inspected request, whether to answer an injected rejection (for load tests in
    real clusters; off by default).

    When enabled, a share of releasable ``do_remote_prefill`` requests (``inject_rate``,
    reproducible with ``inject_seed``, optionally only on ``inject_routes``) and, with
    ``inject_header``, any request carrying ``x-kvr-inject-reject: <status>`` is answered by the
    sidecar with a vLLM-shaped error and never forwarded to D; P's blocks are then released
    exactly as for a real rejection. Injected outcomes carry the cause ``injected`` in metrics and
    ``injected: true`` in logs, so dashboards never mistake them for D's behaviour.
    """

    def __init__(self, config: Config) -> None:
        self._rate = config.inject_rate
        self._random = random.Random(config.inject_seed)
        self._statuses = config.inject_statuses
        self._routes = frozenset(config.inject_routes or INSPECTED_ROUTES)
        self._header = config.inject_header
        self.enabled = bool(self._rate) or self._header

    def status_for(self, route: str, headers: Mapping[bytes, bytes], releasable: bool) -> int | None:
        """The status to inject, or None to forward the request normally; ``headers`` maps the
        request's header names to their first value."""
        if self._header:
            value = headers.get(INJECT_HEADER)
            if value is not None:
                return _status(value)
        if self._rate and releasable and route in self._routes and self._random.random() < self._rate:
            return self._random.choice(self._statuses)
        return None


def _status(value: bytes) -> int | None:
    text = value.strip()
    if text.isdigit() and 400 <= int(text) <= 599:
        return int(text)
    return None


class Forwarder:
    """The bytes' path to D and back (see the module docstring)."""

    def __init__(
        self, upstream: Client, judge: Judge, metrics: Metrics, tracing: Tracing, answers: AnswerStyle = VLLM
    ) -> None:
        self.upstream = upstream
        self._judge = judge
        self._metrics = metrics
        self._tracing = tracing
        self._answers = answers  # how the sidecar answers D's failures (vLLM's shape or llm-d's)

    def judged(self, exchange: Exchange, event: Event) -> None:
        """Hand the exchange's event to the judge (the request path's one way to it); whether the
        response had started is the exchange's."""
        if exchange.responded and not event.started:
            event = msgspec.structs.replace(event, started=True)
        self._judge.judge(exchange, event)

    async def forward(
        self,
        ctx: RequestContext,
        exchange: Exchange,
        headers: list[tuple[str, str]],
        body: bytes,
        watcher: DisconnectWatcher | None = None,
    ) -> None:
        watcher = watcher or DisconnectWatcher(ctx.receive, hub=ctx.scope.get(DISCONNECT_HUB))
        exchange.sent = Sent()
        if exchange.params is not None:
            self._judge.forwarded(exchange)
        leg: Leg | None = None  # the kvr.decode span while the leg to D runs (tracing on)
        if self._tracing.enabled:
            leg = self._tracing.leg("kvr.decode", ctx.method, self.upstream.base_url + ctx.target, headers)
            headers = leg.headers
        try:
            await self._exchange(ctx, exchange.responding(ctx.send), exchange, headers, body, leg)
        except asyncio.CancelledError:
            if not watcher.fired:
                raise
            uncancel()
            if not exchange.decided:
                self.judged(exchange, client_gone(exchange))
                self._metrics.answered(exchange.route, -1)
            if leg is not None:
                leg.failed("client_gone", "the client disconnected")
        except Exception as exc:
            if leg is not None:
                failure = exc.failure.value if isinstance(exc, UpstreamError) else type(exc).__name__
                leg.failed(failure, str(exc))
            raise
        finally:
            watcher.stop()
            if leg is not None:
                leg.end()

    async def _exchange(
        self,
        ctx: RequestContext,
        send: Send,
        exchange: Exchange,
        headers: list[tuple[str, str]],
        body: bytes,
        leg: Leg | None,
    ) -> None:
        try:
            response = await self.upstream.send(ctx.method, ctx.target, headers, body, sent=exchange.sent)
        except UpstreamError as exc:
            await self._failed(send, exchange, exc, leg)
            return
        self._metrics.latency_for(ROUTES[exchange.route]).observe(time.monotonic() - exchange.started)
        async with response:
            await self._respond(send, response, exchange, ctx.scope.get(RELAY), leg)

    async def _failed(self, send: Send, exchange: Exchange, exc: UpstreamError, leg: Leg | None) -> None:
        if leg is not None:
            leg.failed(exc.failure.value, str(exc))
        self.judged(exchange, Event(failure=exc.failure))
        exchange.policy.decode_failed(self._metrics, exc.failure)
        status = FAILURE_STATUS[exc.failure]
        self._metrics.answered(exchange.route, status)
        log.warning(
            "decode server failed before answering",
            extra={"request_id": exchange.request_id, "failure": exc.failure.value, "detail": str(exc)},
        )
        message = f"decode server: {exc}"
        await self._answers.decode_failed(
            send, exc.failure, status, message, exchange.request_id, exchange.retry_headers()
        )

    async def _respond(
        self, send: Send, response: Response, exchange: Exchange, relay: ClientRelay | None, leg: Leg | None
    ) -> None:
        status = response.status
        self._metrics.answered(exchange.route, status)
        if leg is not None:
            leg.status(status)
        exchange.policy.decode_answered(self._metrics, status, time.monotonic() - exchange.started)
        head, closing, events = response_head(response.headers, exchange.request_id)
        if not 200 <= status < 300:
            await self._refused(send, response, exchange, head, closing)
            return
        # D's content type is the word on streaming: vLLM also streams for a lax "stream": "true"
        # or 1, which the request view does not read as a stream.
        streamed = exchange.stream or events
        rewriter = exchange.rewriter
        if rewriter is not None and not streamed and not _encoded(head):
            await self._rewritten(send, response, exchange, head, closing)
            return
        # Judged as the head arrives, before it goes out: D's state learns of Connection: close at
        # once. A stream with parameters is decided by its first event (its head is pending).
        judge = StreamJudge(self._judge, exchange) if streamed and exchange.params is not None else None
        self.judged(
            exchange, Event(status=status, stream=streamed, closing=closing, pending=judge is not None)
        )
        if not streamed and rewriter is None and relay is not None and leg is None:
            await self._whole(send, response, exchange, head, relay)
            return
        await send({"type": "http.response.start", "status": status, "headers": head})
        await self.pump(send, response, judge, rewriter, relay)

    async def _whole(
        self, send: Send, response: Response, exchange: Exchange, head: Head, relay: ClientRelay
    ) -> None:
        """An answer that is not streamed and has nothing to correct, judged already: read whole
        while it is small (``WHOLE_LIMIT``), then its head and body leave in one write
        (``ClientRelay.answer``). A larger one goes on as the pump sends it; one D breaks off
        first goes out as far as it came, then the client's connection is aborted, as the pump
        does (the client sees a cut answer, never a complete one or an error to retry)."""
        status = response.status
        body = response.whole()  # the usual case: the body arrived with its head
        ended = body is not None
        if body is None:
            parts: list[bytes] = []
            size = 0
            try:
                async for chunk in response.chunks():
                    parts.append(chunk)
                    size += len(chunk)
                    if response.ended or size > WHOLE_LIMIT:
                        break
                else:
                    ended = True
            except UpstreamError as exc:
                log.warning("decode server broke the response", extra={"detail": str(exc)})
                await send({"type": "http.response.start", "status": status, "headers": head})
                await send({"type": "http.response.body", "body": b"".join(parts), "more_body": True})
                raise
            ended = ended or response.ended
            body = parts[0] if len(parts) == 1 else b"".join(parts)
        exchange.responded = True
        if ended and relay.answer(status, head, body):
            return
        await send({"type": "http.response.start", "status": status, "headers": head})
        await send({"type": "http.response.body", "body": body, "more_body": not ended})
        if not ended:
            await self.pump(send, response, None, None, relay)

    async def _refused(
        self, send: Send, response: Response, exchange: Exchange, head: Head, closing: bool
    ) -> None:
        """D answered an error: judged on its status and ``error.type`` before the head goes out."""
        status = response.status
        try:
            body = await response.read(ERROR_BODY_LIMIT)
        except UpstreamError as exc:
            # D refused the request (the status says so), then broke off its error body.
            self.judged(exchange, Event(status=status, stream=exchange.stream, closing=closing))
            log.warning("decode server broke off its error response", extra={"detail": str(exc)})
            message = f"decode server broke off its error response: {exc}"
            await send_error(send, status, message, exchange.request_id, extra=exchange.retry_headers())
            return
        error_type, error_message = _error(body)
        event = Event(
            status, exchange.stream, error_type=error_type, error_message=error_message, closing=closing
        )
        self.judged(exchange, event)
        head.extend(exchange.retry_headers())
        await send({"type": "http.response.start", "status": status, "headers": head})
        await send({"type": "http.response.body", "body": body, "more_body": True})
        await self.pump(send, response, None)

    async def _rewritten(
        self, send: Send, response: Response, exchange: Exchange, head: Head, closing: bool
    ) -> None:
        """Router mode, a JSON answer: correct ``cached_tokens`` before it leaves.

        A body larger than ``REWRITE_LIMIT`` passes through unchanged (streamed, not held);
        one D breaks off before it is whole is answered 502 in vLLM's error shape.
        """
        rewriter = exchange.rewriter
        assert rewriter is not None
        self.judged(exchange, Event(status=response.status, stream=False, closing=closing))
        try:
            body = await response.read(REWRITE_LIMIT)
        except UpstreamError as exc:
            log.warning("decode server broke off its answer", extra={"detail": str(exc)})
            await send_error(send, 502, f"decode server broke off its answer: {exc}", exchange.request_id)
            return
        if len(body) >= REWRITE_LIMIT:  # more may follow: forwarded as it is
            await send({"type": "http.response.start", "status": response.status, "headers": head})
            await send({"type": "http.response.body", "body": body, "more_body": True})
            await self.pump(send, response, None)
            return
        body = rewriter.json(body)
        head = [(n, v) for n, v in head if n != b"content-length"]
        head.append((b"content-length", str(len(body)).encode()))
        await send({"type": "http.response.start", "status": response.status, "headers": head})
        await send({"type": "http.response.body", "body": body, "more_body": False})

    async def pump(
        self,
        send: Send,
        response: Response,
        judge: StreamJudge | None,
        rewriter: UsageRewriter | None = None,
        relay: ClientRelay | None = None,
    ) -> None:
        """D's body to the client, chunk by chunk through ``send`` while the judge reads it. Once it
        has judged (at once without one), a ``relay`` takes the rest straight from D's connection
        to the client's (``sidecar.transport.relay``), and the chunks then end."""
        relaying = relay is not None
        plain = judge is None and rewriter is None  # nothing to do after the last chunk but end
        ended = False
        try:
            async for chunk in response.chunks():
                if judge is not None:
                    judge.feed(chunk)
                if rewriter is not None:
                    chunk = rewriter.feed(chunk)
                # D's whole body is in: its last bytes and the response's end go in one send
                ended = plain and response.ended
                await send({"type": "http.response.body", "body": chunk, "more_body": not ended})
                if relaying and not ended and (judge is None or judge.decided):
                    assert relay is not None
                    relaying = False  # relayed to its end, or not at all (then the chunks go on)
                    await response.relay(relay, rewriter)
        except UpstreamError as exc:
            if judge is not None:
                judge.reset()
            log.warning("decode server broke the response", extra={"detail": str(exc)})
            raise
        if judge is not None:
            judge.finish()
        if not ended:
            tail = rewriter.flush() if rewriter is not None else b""
            await send({"type": "http.response.body", "body": tail, "more_body": False})

    async def passthrough(self, ctx: RequestContext) -> None:
        """Any other request: to D unchanged, the body streamed, the answer pumped."""
        watcher = DisconnectWatcher(ctx.receive, ctx.has_body, ctx.scope.get(DISCONNECT_HUB))
        body = watcher.body() if watcher.body_pending else None
        try:
            try:
                response = await self.upstream.send(ctx.method, ctx.target, ctx.headers, body)
            except UpstreamError as exc:
                status = FAILURE_STATUS[exc.failure]
                await self._answers.decode_failed(
                    ctx.send, exc.failure, status, f"decode server: {exc}", ctx.request_id
                )
                return
            async with response:
                head = response_headers(response.headers, ctx.request_id)
                if response.status == 304:
                    # A 304 may name the representation's length, but has no body: uvicorn would
                    # wait for that many bytes and fail the response.
                    head = [(n, v) for n, v in head if n != b"content-length"]
                await ctx.send({"type": "http.response.start", "status": response.status, "headers": head})
                await self.pump(ctx.send, response, None, relay=ctx.scope.get(RELAY))
        except asyncio.CancelledError:
            if not watcher.fired:
                raise
            uncancel()
        finally:
            watcher.stop()


def _encoded(head: Head) -> bool:
    return any(name == b"content-encoding" and value not in (b"identity", b"") for name, value in head)


def _error(body: bytes) -> tuple[str | None, str | None]:
    """The ``error.type`` and ``error.message`` of vLLM's error body (OpenAI's shape, or
    Anthropic's on ``/v1/messages``), when it is one."""
    for decoder in (ERROR_DECODER, ANTHROPIC_ERROR_DECODER):
        try:
            error = decoder.decode(body).error
        except (msgspec.DecodeError, msgspec.ValidationError):
            continue
        return error.type, error.message
    return None, None


async def _answer_if_unanswered(send: Send, status: int, message: str, request_id: str) -> None:
    """An error answer unless a response already started (uvicorn refuses a second start);
    bounded, so a client that reads nothing cannot hold the shutdown."""
    with contextlib.suppress(RuntimeError, TimeoutError):
        async with asyncio.timeout(1.0):
            await send_error(send, status, message, request_id)
