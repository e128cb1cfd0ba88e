"""Forwarding to D and answering the client: the bytes' path through the proxy.

``Forwarder.forward`` sends an inspected request to D and answers the client
from D's response: an error answer (read whole, up to ``ERROR_BODY_LIMIT``)
is judged before its head goes out, so the judge's headers can join it; a
200 is pumped as raw bytes, a stream judged from its first event as it
passes, a router-mode JSON answer corrected (``cached_tokens``) first. A
failure before any answer is judged and answered in vLLM's error shape.
``passthrough`` forwards everything else unchanged, request body streamed.
A client that disconnects cancels the exchange and closes the upstream
response, so D sees the abort.
"""

from __future__ import annotations

import asyncio
import logging
import time

import msgspec

from sidecar.asgi import DISCONNECT_HUB, Send
from sidecar.classify import FAILURE_STATUS, Event
from sidecar.decision.judge import Judge, StreamJudge
from sidecar.observability.metrics import ROUTES, Metrics, status_class
from sidecar.observability.tracing import Leg, Tracing
from sidecar.proxy.answers import VLLM, AnswerStyle, send_error
from sidecar.proxy.context import Exchange, RequestContext
from sidecar.proxy.disconnect import DisconnectWatcher, client_gone, uncancel
from sidecar.proxy.headers import response_head, response_headers
from sidecar.proxy.usage import UsageRewriter
from sidecar.transport.relay import RELAY, ClientRelay
from sidecar.upstream import Client, Response, Sent, UpstreamError
from sidecar.wire import ANTHROPIC_ERROR_DECODER, ERROR_DECODER

log = logging.getLogger("sidecar.proxy")

ERROR_BODY_LIMIT = 64 * 1024
REWRITE_LIMIT = 16 * 1024 * 1024
WHOLE_LIMIT = 64 * 1024  # a JSON answer up to this size is read whole, then written at once
Head = list[tuple[bytes, bytes]]


class Forwarder:
    """The proxy's traffic with D (see the module docstring)."""

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

    def count(self, route: str, status: int) -> None:
        """``kvr_requests_total`` for one answer (``status`` < 0: the client left)."""
        label = status_class(status) if status >= 0 else "client_gone"
        self._metrics.request_counter(ROUTES[route], label).inc()

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
                self.count(exchange.route, -1)
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
        self.count(exchange.route, status)
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
        self.count(exchange.route, status)
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
