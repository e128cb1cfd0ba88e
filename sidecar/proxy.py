"""The request path: forward everything to D, inspect the three completion routes.

Every method and path goes to D unchanged. For ``POST`` on
``/v1/chat/completions``, ``/v1/completions`` and ``/v1/responses`` the body
is read once under the cap, only ``stream``, ``n`` and ``kv_transfer_params``
are decoded, and the original bytes are forwarded. What happens next (D's
status, the first SSE event of a stream, or the failure that kept an answer
from arriving) is classified, and a definite pre-admission rejection of a
releasable request becomes a ``ReleaseJob`` handed to the pipeline, which
never delays the client. Responses are pumped as raw bytes; a client that
disconnects cancels the exchange and closes the upstream response, so D
sees the abort.

This is a plain ASGI callable rather than a Starlette route: the catch-all
needs no routing, and skipping the framework's request objects keeps the
proxy's CPU per request inside the benchmark's budget.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import msgspec

from sidecar import params as params_mod
from sidecar.asgi import Receive, Scope, Send
from sidecar.body import ClientGone, Oversized, read_body, tail_params
from sidecar.classify import ROUTER_RELEASES, Cause, Decision, Event, Failure, Outcome, classify, stream_event
from sidecar.config import Config
from sidecar.errors import CLOSE, FAILURE_STATUS, INJECTED, NO_RETRY, send_error, send_raw
from sidecar.faults import Injector
from sidecar.headers import data_parallel_rank, new_request_id, request_headers, response_headers
from sidecar.limits import over_limit
from sidecar.metrics import ROUTES, Metrics, status_class
from sidecar.release.base import ReleaseJob
from sidecar.release.pipeline import Pipeline
from sidecar.router import (
    HEADER as ROUTER_HEADER,
)
from sidecar.router import (
    PrefillPool,
    PrefillResult,
    RouterError,
    UsageRewriter,
    decode_body,
    prefill_body,
    prefill_headers,
)
from sidecar.sse import FirstEventScanner
from sidecar.tracing import OFF, Leg, Tracing
from sidecar.trust import InFlight, Trust
from sidecar.upstream import Sent, Upstream, UpstreamError, UpstreamResponse
from sidecar.wire import ERROR_DECODER, VIEW_DECODER, lax_bool

log = logging.getLogger("sidecar.proxy")

ERROR_BODY_LIMIT = 64 * 1024
REWRITE_LIMIT = 16 * 1024 * 1024


@dataclass(slots=True)
class Exchange:
    """One inspected request on its way through the proxy."""

    request_id: str
    route: str
    params: params_mod.ReleaseParams | None
    stream: bool
    started: float
    sent: Sent | None = None  # learns whether the request reached D's socket
    responded: bool = False  # http.response.start was sent
    decided: bool = False  # classified (at most once)
    router: bool = False  # router mode: the sidecar ran the prefill leg itself
    body_request_id: str | None = None  # the body's request_id field, if a string
    rewriter: UsageRewriter | None = None  # router mode: corrects cached_tokens
    leg: Leg | None = None  # the kvr.decode span while the leg to D runs (tracing on)
    raw_params: bytes | None = None  # kv_transfer_params as received (for the http strategy)
    data_parallel_rank: int | None = None  # the request's X-data-parallel-rank, if valid
    # Sidecar mode, no X-Request-Id from the client: the sidecar made one up, which P never saw.
    request_id_generated: bool = False
    # Its parameters went to a release (sidecar mode, a strategy that frees): an error answer
    # says x-should-retry: false, since a retry with them would get 409.
    spent: bool = False

    def retry_headers(self) -> tuple[tuple[bytes, bytes], ...]:
        return (NO_RETRY,) if self.spent else ()


class Proxy:
    """The proxy's ASGI handler for ``http`` scopes."""

    def __init__(
        self,
        config: Config,
        upstream: Upstream,
        pipeline: Pipeline,
        metrics: Metrics,
        tracing: Tracing = OFF,
    ) -> None:
        self.config = config
        self.tracing = tracing  # hooks below are guarded by tracing.enabled (one attribute check)
        self.injector = Injector(config)
        self.trust = Trust(config)
        self.inflight = InFlight(config.ledger_size, config.release_deadline)
        self.router = PrefillPool(config) if config.prefill or config.prefill_allow else None
        self.upstream = upstream
        self.pipeline = pipeline
        self.metrics = metrics
        self.stopping = False  # set once the drain began: new inspected requests are refused
        self._scan_limit = config.max_body_bytes * 4
        # Bodies read at once for requests above limit_concurrency (to release what they name);
        # past this many, such requests are refused unread and P's lease frees their blocks.
        self._over_limit_cap = max(8, config.limit_concurrency // 4)
        self._over_limit_reads = 0
        self._keeps_raw = config.release in ("http", "auto")
        self._frees = config.release in ("nixl", "http", "auto")  # off and dry-run free nothing

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path: str = scope["path"]
        route = path if scope["method"] == "POST" and path in ROUTES else None
        self.metrics.inflight.inc()
        try:
            if route is not None and self.tracing.enabled:
                with self.tracing.server_span(scope) as span:
                    await self._handle(scope, receive, span.watch(send), route)
            else:
                await self._handle(scope, receive, send, route)
        except asyncio.CancelledError:
            # uvicorn cancels what still runs past drain_timeout at shutdown (a client's own
            # disconnect is handled where it happens). Answer in vLLM's shape if nothing was
            # sent yet, instead of uvicorn's plain-text 500 and a logged traceback.
            self._uncancel()
            request_id = (_header(scope, b"x-request-id") or b"").decode("latin-1") or new_request_id()
            await _answer_if_unanswered(send, 503, "the sidecar is shutting down", request_id)
        finally:
            self.metrics.inflight.dec()

    async def _handle(self, scope: Scope, receive: Receive, send: Send, route: str | None) -> None:
        headers, request_id, generated = request_headers(scope["headers"])
        if over_limit(scope):
            await self._over_limit(scope, receive, send, route, request_id, generated)
            return
        if route is None:
            await self._passthrough(scope, receive, send, headers, request_id)
            return
        try:
            body = await read_body(receive, self.config.max_body_bytes, self._scan_limit)
        except ClientGone:
            # Without the whole body there are no trustworthy parameters to release.
            self.metrics.request_counter(ROUTES[route], "client_gone").inc()
            return
        if isinstance(body, Oversized):
            await self._too_large(scope, send, body, route, request_id, generated)
            return
        if self.router is not None:
            routed = _header(scope, ROUTER_HEADER)
            if routed is not None or self.router.static:
                await self._route(scope, receive, send, headers, body, route, request_id, routed)
                return
        exchange = self._exchange(body, route, request_id, scope["headers"], generated)
        if (
            exchange.params is not None
            and self.pipeline.holds(_key(exchange))
            and await self._replay(send, exchange)
        ):
            return
        if self.stopping:
            await self._refuse(send, exchange, Failure.SHUTTING_DOWN, "the sidecar is shutting down")
            return
        if self.injector.enabled:
            status = self.injector.status_for(route, scope["headers"], exchange.params is not None)
            if status is not None:
                await self._inject(send, exchange, status)
                return
        await self._forward(scope, receive, send, headers, body, exchange)

    async def _route(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        headers: list[tuple[str, str]],
        body: bytes,
        route: str,
        request_id: str,
        routed: bytes | None,
    ) -> None:
        """Router mode: prefill on P, then decode on D with P's parameters."""
        assert self.router is not None
        started = time.monotonic()
        try:
            request = msgspec.json.decode(body)
        except (msgspec.DecodeError, RecursionError):
            request = None
        if not isinstance(request, dict):  # D answers a body that is not a JSON object
            await self._forward(
                scope, receive, send, headers, body, Exchange(request_id, route, None, False, started)
            )
            return
        if request.pop("kv_transfer_params", None) is not None:
            self.metrics.ineligible.labels("client_params_dropped").inc()
        stream = lax_bool(request.get("stream")) is True
        n = request.get("n")
        if isinstance(n, int) and not isinstance(n, bool) and n > 1:
            await self._multi_choice(scope, receive, send, headers, request, route, request_id, started)
            return
        try:
            candidates = self.router.candidates(routed)
        except RouterError as exc:
            self._count(route, exc.status)
            await send_error(send, exc.status, str(exc), request_id, exc.param)
            return
        watcher = _DisconnectWatcher(receive)
        try:
            prefilled = await self._prefill_leg(
                candidates, route, request, headers, request_id, watcher, data_parallel_rank(scope["headers"])
            )
        except asyncio.CancelledError:
            watcher.stop()  # cancelled from outside (shutdown past drain_timeout): no watcher left behind
            raise
        except RouterError as exc:
            watcher.stop()
            await self._prefill_failed(
                scope, receive, send, headers, request, route, request_id, started, exc
            )
            return
        if prefilled is None:  # the client left during the prefill leg (released there)
            watcher.stop()
            return
        raw = msgspec.json.encode(prefilled.params) if prefilled.params else None
        eligibility = params_mod.check(raw) if raw else None
        exchange = Exchange(
            request_id,
            route,
            eligibility.params if eligibility else None,
            stream,
            started,
            router=True,
            rewriter=UsageRewriter(prefilled.cached_tokens, stream),
            raw_params=self._raw_for_release(raw),
            data_parallel_rank=data_parallel_rank(scope["headers"]),
        )
        if self.stopping:
            watcher.stop()
            await self._refuse(send, exchange, Failure.SHUTTING_DOWN, "the sidecar is shutting down")
            return
        if self.injector.enabled:
            status = self.injector.status_for(route, scope["headers"], exchange.params is not None)
            if status is not None:
                watcher.stop()
                await self._inject(send, exchange, status)
                return
        decode = decode_body(request, prefilled.params)
        signed = (
            self.trust.outgoing(request_id, msgspec.json.encode(prefilled.params)) if prefilled.params else []
        )
        await self._forward(scope, receive, send, _sized(headers, decode) + signed, decode, exchange, watcher)

    async def _prefill_leg(
        self,
        candidates: list[str],
        route: str,
        request: dict[str, object],
        headers: list[tuple[str, str]],
        request_id: str,
        watcher: _DisconnectWatcher,
        dp_rank: int | None,
    ) -> PrefillResult | None:
        """Try one P, then one other; None when the client left (P's blocks are released)."""
        assert self.router is not None
        task = asyncio.ensure_future(self._try_prefill(candidates, route, request, headers))
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            if not watcher.fired:
                task.cancel()
                raise
            self._uncancel()
        # The client went away: P still answers (bounded by prefill_timeout); release what it kept.
        await asyncio.wait({task})
        if task.cancelled() or task.exception() is not None:
            return None
        result = task.result()
        raw = msgspec.json.encode(result.params) if result.params else None
        eligibility = params_mod.check(raw) if raw else None
        exchange = Exchange(
            request_id, route, eligibility.params if eligibility else None, False, time.monotonic()
        )
        exchange.router, exchange.raw_params = True, self._raw_for_release(raw)
        exchange.data_parallel_rank = dp_rank
        self._decide(exchange, Event(failure=Failure.CLIENT_GONE_BEFORE_FORWARD))
        self._count(route, -1)
        return None

    async def _try_prefill(
        self, candidates: list[str], route: str, request: dict[str, object], headers: list[tuple[str, str]]
    ) -> PrefillResult:
        assert self.router is not None
        body = prefill_body(request, route)
        p_headers = _sized(prefill_headers(headers), body)
        last: Exception | None = None
        for url in candidates[:2]:  # a failing P leg is tried once on another P
            started = time.monotonic()
            try:
                if self.tracing.enabled:
                    with self.tracing.leg_span("kvr.prefill", "POST", url + route, p_headers) as leg:
                        result = await self.router.prefill(url, route, body, leg.headers)
                else:
                    result = await self.router.prefill(url, route, body, p_headers)
            except RouterError as exc:
                if exc.status < 500:
                    raise  # P refused the request itself: the client sees P's answer
                last = exc
                self.metrics.leg_failures.labels("prefill", f"status_{exc.status // 100}xx").inc()
            except UpstreamError as exc:
                last = exc
                self.metrics.leg_failures.labels("prefill", exc.failure.value).inc()
            else:
                self.metrics.leg_latency.labels("prefill").observe(time.monotonic() - started)
                return result
            self.router.mark_failed(url)
            log.warning("prefill leg failed", extra={"prefill": url, "detail": str(last)})
        raise RouterError(503, f"no prefill server available ({last or 'none configured'})")

    async def _prefill_failed(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        headers: list[tuple[str, str]],
        request: dict[str, object],
        route: str,
        request_id: str,
        started: float,
        exc: RouterError,
    ) -> None:
        if exc.body is not None:  # P's own answer to a bad request
            self._count(route, exc.status)
            await send_raw(send, exc.status, exc.body, request_id)
            return
        if self.config.decode_only_fallback:
            self.metrics.leg_failures.labels("prefill", "decode_only_fallback").inc()
            await self._decode_only(scope, receive, send, headers, request, route, request_id, started)
            return
        self._count(route, exc.status)
        await send_error(send, exc.status, str(exc), request_id)

    async def _multi_choice(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        headers: list[tuple[str, str]],
        request: dict[str, object],
        route: str,
        request_id: str,
        started: float,
    ) -> None:
        """``n > 1``: P would strand the sibling choices' blocks, so never on the P/D path."""
        if self.config.decode_only_fallback:
            await self._decode_only(scope, receive, send, headers, request, route, request_id, started)
            return
        self._count(route, 400)
        message = "n > 1 is not supported on the prefill/decode path (set decode_only_fallback to allow it)"
        await send_error(send, 400, message, request_id, "n")

    async def _decode_only(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        headers: list[tuple[str, str]],
        request: dict[str, object],
        route: str,
        request_id: str,
        started: float,
    ) -> None:
        """D prefills itself: the request goes to D without kv_transfer_params."""
        body = decode_body(request, None)
        exchange = Exchange(request_id, route, None, lax_bool(request.get("stream")) is True, started)
        await self._forward(scope, receive, send, _sized(headers, body), body, exchange)

    async def _inject(self, send: Send, exchange: Exchange, status: int) -> None:
        """Answer an injected rejection; D never sees the request (``sidecar.faults``)."""
        self._decide(exchange, Event(failure=Failure.INJECTED), status=status)
        self.metrics.injected.labels(status_class(status)).inc()
        self._count(exchange.route, status)
        await send_error(
            send,
            status,
            "rejection injected by kv-release-sidecar (load test)",
            exchange.request_id,
            extra=(INJECTED, *exchange.retry_headers()),
        )

    def _exchange(
        self,
        body: bytes,
        route: str,
        request_id: str,
        client_headers: list[tuple[bytes, bytes]],
        generated: bool,
    ) -> Exchange:
        started = time.monotonic()
        try:
            view = VIEW_DECODER.decode(body)
        except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
            # Not a JSON object: forwarded as it is, D answers it; nothing to release.
            self.metrics.ineligible.labels("not_json").inc()
            return Exchange(request_id, route, None, False, started)
        eligibility = params_mod.check(view.kv_transfer_params)
        if eligibility.reason is not None and eligibility.reason is not params_mod.Ineligible.NO_PARAMS:
            self.metrics.ineligible.labels(eligibility.reason.value).inc()
            if eligibility.reason is params_mod.Ineligible.MALFORMED:
                log.warning(
                    "malformed kv_transfer_params, will not release",
                    extra={"request_id": request_id, "detail": eligibility.detail},
                )
        body_id = view.request_id if isinstance(view.request_id, str) else None
        params = eligibility.params
        if params is not None and not self.trust.trusted(
            client_headers, request_id, bytes(view.kv_transfer_params)
        ):
            # Forwarded unchanged, never released: anyone could name another tenant's blocks.
            self.metrics.ineligible.labels("untrusted").inc()
            params = None
        return Exchange(
            request_id,
            route,
            params,
            lax_bool(view.stream) is True,
            started,
            body_request_id=body_id,
            raw_params=self._raw_for_release(bytes(view.kv_transfer_params) if params is not None else None),
            data_parallel_rank=data_parallel_rank(client_headers),
            request_id_generated=generated,
        )

    async def _replay(self, send: Send, exchange: Exchange) -> bool:
        """A request naming parameters already handed to a release: refused when P frees them.

        Once released, P may reuse those blocks: D reading them would decode from another
        request's cache, silently. So the parameters are single-use after a rejection (as
        with vLLM's own release, 0.21.0+), and the caller must prefill again. With a strategy
        that frees nothing (``off``, ``dry-run``) the request is forwarded and only counted.
        True when the request was answered here.
        """
        if not self._frees:
            self.metrics.replays.labels("forwarded").inc()
            log.warning(
                "request reuses parameters of a released request (forwarded: the strategy frees nothing)",
                extra={"request_id": exchange.request_id},
            )
            return False
        self.metrics.replays.labels("refused").inc()
        self._count(exchange.route, 409)
        log.warning(
            "request reuses parameters already released to P; refused",
            extra={"request_id": exchange.request_id},
        )
        message = (
            "kv_transfer_params were released to the prefill server after an earlier rejection of a "
            "request with them; run the prefill again"
        )
        await send_error(send, 409, message, exchange.request_id, "kv_transfer_params", (NO_RETRY,))
        return True

    async def _too_large(
        self, scope: Scope, send: Send, body: Oversized, route: str, request_id: str, generated: bool
    ) -> None:
        raw = tail_params(body.tail) if body.complete else None
        eligibility = params_mod.check(raw) if raw else None
        params = eligibility.params if eligibility else None
        if params is not None and self._routed(scope):
            params = None  # router mode drops client parameters: they could name any P's blocks
        if params is not None and raw and not self.trust.trusted(scope["headers"], request_id, raw):
            self.metrics.ineligible.labels("untrusted").inc()
            params = None
        exchange = Exchange(
            request_id, route, params, False, time.monotonic(), request_id_generated=generated
        )
        exchange.raw_params = self._raw_for_release(raw if params is not None else None)
        message = f"request body of {body.size} bytes exceeds the limit of {self.config.max_body_bytes}"
        # Past scan_limit the rest of the body is unread: shed the connection rather than have the
        # server read and discard an unbounded remainder outside limit_concurrency.
        await self._refuse(send, exchange, Failure.BODY_TOO_LARGE, message, close=not body.complete)

    def _routed(self, scope: Scope) -> bool:
        """Router mode for this request: a static P pool, or llm-d's prefiller header."""
        return self.router is not None and (
            bool(self.router.static) or _header(scope, ROUTER_HEADER) is not None
        )

    def _raw_for_release(self, raw: bytes | None) -> bytes | None:
        """The parameters as sent, kept only for strategies that hand them on (``http``, ``auto``)."""
        return raw if raw is not None and self._keeps_raw else None

    async def _refuse(
        self, send: Send, exchange: Exchange, failure: Failure, message: str, close: bool = False
    ) -> None:
        """The sidecar answers itself; D never sees the request."""
        self._decide(exchange, Event(failure=failure))
        status = FAILURE_STATUS[failure]
        self._count(exchange.route, status)
        extra = (*exchange.retry_headers(), *((CLOSE,) if close else ()))
        await send_error(send, status, message, exchange.request_id, extra=extra)

    async def _over_limit(
        self, scope: Scope, receive: Receive, send: Send, route: str | None, request_id: str, generated: bool
    ) -> None:
        """Above ``limit_concurrency``: 503 and the connection shed; D never sees the request.

        An inspected request's body is read first (the usual caps and timers) so that the
        blocks it names are released, as for any rejection before D (cause ``overloaded``);
        at most ``_over_limit_cap`` such bodies at once. A passthrough request, a router-mode
        request (no prefill ran yet; client parameters are dropped there) and any past the
        cap are refused unread.
        """
        message = "the sidecar is at its concurrency limit"
        if route is None or self._routed(scope) or self._over_limit_reads >= self._over_limit_cap:
            if route is not None:
                self._count(route, 503)
            await send_error(send, 503, message, request_id, extra=(CLOSE,))
            return
        self._over_limit_reads += 1
        try:
            body = await read_body(receive, self.config.max_body_bytes, self._scan_limit)
        except ClientGone:
            self.metrics.request_counter(ROUTES[route], "client_gone").inc()
            return
        finally:
            self._over_limit_reads -= 1
        if isinstance(body, Oversized):
            await self._too_large(scope, send, body, route, request_id, generated)
            return
        exchange = self._exchange(body, route, request_id, scope["headers"], generated)
        await self._refuse(send, exchange, Failure.OVERLOADED, message, close=True)

    async def _forward(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        headers: list[tuple[str, str]],
        body: bytes,
        exchange: Exchange,
        watcher: _DisconnectWatcher | None = None,
    ) -> None:
        watcher = watcher or _DisconnectWatcher(receive)
        exchange.sent = Sent()
        if exchange.params is not None:
            self.inflight.forwarded(_key(exchange))
        if self.tracing.enabled:
            exchange.leg = self.tracing.leg("kvr.decode", scope["method"], self._decode_url(scope), headers)
            headers = exchange.leg.headers
        try:
            try:
                response = await self.upstream.send(
                    scope["method"], _target(scope), headers, body, sent=exchange.sent
                )
            except UpstreamError as exc:
                await self._upstream_failed(send, exchange, exc)
                return
            self.metrics.latency_for(ROUTES[exchange.route]).observe(time.monotonic() - exchange.started)
            async with response:
                await self._respond(send, response, exchange)
        except asyncio.CancelledError:
            if not watcher.fired:
                raise
            self._uncancel()
            if not exchange.decided:
                self._decide(exchange, _client_gone(exchange))
                self._count(exchange.route, -1)
            if exchange.leg is not None:
                exchange.leg.failed("client_gone", "the client disconnected")
        except Exception as exc:
            if exchange.leg is not None:
                failure = exc.failure.value if isinstance(exc, UpstreamError) else type(exc).__name__
                exchange.leg.failed(failure, str(exc))
            raise
        finally:
            watcher.stop()
            if exchange.leg is not None:
                exchange.leg.end()

    def _decode_url(self, scope: Scope) -> str:
        return self.upstream.base_url + _target(scope)

    async def _upstream_failed(self, send: Send, exchange: Exchange, exc: UpstreamError) -> None:
        if exchange.leg is not None:
            exchange.leg.failed(exc.failure.value, str(exc))
        self._decide(exchange, Event(failure=exc.failure))
        status = FAILURE_STATUS[exc.failure]
        self._count(exchange.route, status)
        if exchange.router:
            self.metrics.leg_failures.labels("decode", exc.failure.value).inc()
        log.warning(
            "decode server failed before answering",
            extra={"request_id": exchange.request_id, "failure": exc.failure.value, "detail": str(exc)},
        )
        await send_error(
            send, status, f"decode server: {exc}", exchange.request_id, extra=exchange.retry_headers()
        )

    async def _respond(self, send: Send, response: UpstreamResponse, exchange: Exchange) -> None:
        status = response.status
        self._count(exchange.route, status)
        if exchange.leg is not None:
            exchange.leg.status(status)
        if exchange.router:
            self.metrics.leg_latency.labels("decode").observe(time.monotonic() - exchange.started)
            if status >= 400:
                self.metrics.leg_failures.labels("decode", f"status_{status // 100}xx").inc()
        head = response_headers(response.headers, exchange.request_id)
        if not 200 <= status < 300:
            try:
                body = await response.read(ERROR_BODY_LIMIT)
            except UpstreamError as exc:
                # D refused the request (the status says so), then broke off its error body.
                self._decide(exchange, Event(status=status, stream=exchange.stream))
                log.warning("decode server broke off its error response", extra={"detail": str(exc)})
                message = f"decode server broke off its error response: {exc}"
                await send_error(send, status, message, exchange.request_id, extra=exchange.retry_headers())
                return
            self._decide(exchange, Event(status=status, stream=exchange.stream), _error_type(body))
            exchange.responded = True
            head.extend(exchange.retry_headers())
            await send({"type": "http.response.start", "status": status, "headers": head})
            await send({"type": "http.response.body", "body": body, "more_body": True})
            await self._pump(send, response.chunks(), None)
            return
        # D's content type is the word on streaming: vLLM also streams for a lax "stream": "true"
        # or 1, which the request view does not read as a stream.
        streamed = exchange.stream or _event_stream(head)
        rewriter = exchange.rewriter
        if rewriter is not None and not streamed and not _encoded(head):
            await self._respond_rewritten(send, response, exchange, head, rewriter)
            return
        exchange.responded = True
        await send({"type": "http.response.start", "status": status, "headers": head})
        if streamed and exchange.params is not None:
            await self._pump(send, response.chunks(), _StreamJudge(self, exchange), rewriter)
        else:
            self._decide(exchange, Event(status=status, stream=streamed))
            await self._pump(send, response.chunks(), None, rewriter)

    async def _respond_rewritten(
        self,
        send: Send,
        response: UpstreamResponse,
        exchange: Exchange,
        head: list[tuple[bytes, bytes]],
        rewriter: UsageRewriter,
    ) -> None:
        """Router mode, a JSON answer: correct ``cached_tokens`` before it leaves.

        A body larger than ``REWRITE_LIMIT`` passes through unchanged (streamed, not held);
        one D breaks off before it is whole is answered 502 in vLLM's error shape.
        """
        self._decide(exchange, Event(status=response.status, stream=False))
        try:
            body = await response.read(REWRITE_LIMIT)
        except UpstreamError as exc:
            log.warning("decode server broke off its answer", extra={"detail": str(exc)})
            await send_error(send, 502, f"decode server broke off its answer: {exc}", exchange.request_id)
            return
        exchange.responded = True
        if len(body) >= REWRITE_LIMIT:  # more may follow: forwarded as it is
            await send({"type": "http.response.start", "status": response.status, "headers": head})
            await send({"type": "http.response.body", "body": body, "more_body": True})
            await self._pump(send, response.chunks(), None)
            return
        body = rewriter.json(body)
        head = [(n, v) for n, v in head if n != b"content-length"]
        head.append((b"content-length", str(len(body)).encode()))
        await send({"type": "http.response.start", "status": response.status, "headers": head})
        await send({"type": "http.response.body", "body": body, "more_body": False})

    async def _pump(
        self,
        send: Send,
        chunks: AsyncIterator[bytes],
        judge: _StreamJudge | None,
        rewriter: UsageRewriter | None = None,
    ) -> None:
        try:
            async for chunk in chunks:
                if judge is not None:
                    judge.feed(chunk)
                if rewriter is not None:
                    chunk = rewriter.feed(chunk)
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except UpstreamError as exc:
            if judge is not None:
                judge.reset()
            log.warning("decode server broke the response", extra={"detail": str(exc)})
            raise
        if judge is not None:
            judge.finish()
        tail = rewriter.flush() if rewriter is not None else b""
        await send({"type": "http.response.body", "body": tail, "more_body": False})

    async def _passthrough(
        self, scope: Scope, receive: Receive, send: Send, headers: list[tuple[str, str]], request_id: str
    ) -> None:
        watcher = _DisconnectWatcher(receive, body_pending=_has_body(scope))
        body = watcher.body() if watcher.body_pending else None
        try:
            try:
                response = await self.upstream.send(scope["method"], _target(scope), headers, body)
            except UpstreamError as exc:
                await send_error(send, FAILURE_STATUS[exc.failure], f"decode server: {exc}", request_id)
                return
            async with response:
                head = response_headers(response.headers, request_id)
                if response.status == 304:
                    # A 304 may name the representation's length, but has no body: uvicorn would
                    # wait for that many bytes and fail the response.
                    head = [(n, v) for n, v in head if n != b"content-length"]
                await send({"type": "http.response.start", "status": response.status, "headers": head})
                await self._pump(send, response.chunks(), None)
        except asyncio.CancelledError:
            if not watcher.fired:
                raise
            self._uncancel()
        finally:
            watcher.stop()

    def _decide(
        self, exchange: Exchange, event: Event, error_type: str | None = None, status: int | None = None
    ) -> Decision:
        decision = classify(event)
        if exchange.router and self.config.decode_releases and event.failure is None:
            # An answer came back through the decode sidecar, which judged it and released what
            # it had to: releasing here too would notify P twice.
            decision = Decision(Outcome.NO_RELEASE, Cause.DELEGATED)
        elif exchange.router and decision.cause in ROUTER_RELEASES:
            decision = Decision(Outcome.RELEASE, decision.cause)
        exchange.decided = True
        params = exchange.params
        if params is None:
            if self.tracing.enabled:
                self.tracing.decided(decision.outcome.value, decision.cause.value, "no_params")
            return decision
        releases = decision.releases(self.config.release_ambiguous)
        key = _key(exchange)
        if exchange.sent is not None:
            self.inflight.finished(key, admitted=not releases)
        if not releases:
            self.metrics.not_released.labels(decision.outcome.value, decision.cause.value).inc()
            if self.tracing.enabled:
                self.tracing.decided(decision.outcome.value, decision.cause.value, "not_released")
            return decision
        if self.inflight.may_be_read(key):
            # Another request with these parameters is at D or was admitted: D may be reading them.
            self.metrics.not_released.labels(Outcome.NO_RELEASE.value, "params_in_use").inc()
            log.warning(
                "rejected request reuses parameters D may be reading; not released",
                extra={"request_id": exchange.request_id},
            )
            if self.tracing.enabled:
                self.tracing.decided(decision.outcome.value, decision.cause.value, "params_in_use")
            return decision
        if exchange.sent is not None and decision.cause in ROUTER_RELEASES:
            # The sidecar aborted a request D had (header timeout, client gone): D's handler cleans
            # up (vLLM 0.21.0+) or D is still reading. A later request with these parameters must
            # not be released meanwhile, as after an admission.
            self.inflight.admitted(key)
        self.metrics.rejections.labels(decision.cause.value).inc()
        now = time.monotonic()
        queued = self.pipeline.submit(
            ReleaseJob(
                request_id=exchange.request_id,
                request_id_generated=exchange.request_id_generated and not exchange.router,
                route=exchange.route,
                body_request_id=exchange.body_request_id,
                params=params,
                cause=decision.cause.value,
                status=event.status if status is None else status,
                error_type=error_type,
                injected=event.failure is Failure.INJECTED,
                detected_at=now,
                deadline=now + self.config.release_deadline,
                raw_params=exchange.raw_params,
                data_parallel_rank=exchange.data_parallel_rank,
                trace_context=self.tracing.job_context() if self.tracing.enabled else None,
            )
        )
        exchange.spent = self._frees and not exchange.router
        if self.tracing.enabled:
            release = "queued" if queued else "duplicate"
            self.tracing.decided(decision.outcome.value, decision.cause.value, release)
        return decision

    def _count(self, route: str, status: int) -> None:
        label = status_class(status) if status >= 0 else "client_gone"
        self.metrics.request_counter(ROUTES[route], label).inc()

    @staticmethod
    def _uncancel() -> None:
        task = asyncio.current_task()
        if task is not None:
            task.uncancel()


async def _answer_if_unanswered(send: Send, status: int, message: str, request_id: str) -> None:
    """An error answer unless a response already started (uvicorn refuses a second start);
    bounded, so a client that reads nothing cannot hold the shutdown."""
    with contextlib.suppress(RuntimeError, TimeoutError):
        async with asyncio.timeout(1.0):
            await send_error(send, status, message, request_id)


def _key(exchange: Exchange) -> tuple[str, str]:
    params = exchange.params
    assert params is not None
    return (params.remote_engine_id or "", params.remote_request_id or exchange.request_id)


def _client_gone(exchange: Exchange) -> Event:
    """The client left before the exchange was classified."""
    if exchange.responded:  # D answered 200 and streams: it has the request
        return Event(status=200, stream=True)
    if exchange.sent is not None and exchange.sent.may_have_reached_d:  # D may have admitted it
        return Event(failure=Failure.CLIENT_GONE_AFTER_FORWARD)
    return Event(failure=Failure.CLIENT_GONE_BEFORE_FORWARD)


class _StreamJudge:
    """Classifies a 200 stream from its first SSE event while the bytes pass through."""

    def __init__(self, proxy: Proxy, exchange: Exchange) -> None:
        self._proxy, self._exchange = proxy, exchange
        self._scanner = FirstEventScanner(skip_lead=exchange.route == "/v1/responses")

    def feed(self, chunk: bytes) -> None:
        if self._exchange.decided:
            return
        first = self._scanner.feed(chunk)
        if first is not None:
            self._decide(stream_event(first), first.error_type)

    def finish(self) -> None:
        if not self._exchange.decided:
            first = self._scanner.finish()
            self._decide(stream_event(first), first.error_type)

    def reset(self) -> None:
        """D broke the stream before its first event ended: D may have admitted it."""
        if not self._exchange.decided:
            self._decide(Event(failure=Failure.RESET_AFTER_SEND), None)

    def _decide(self, event: Event, error_type: str | None) -> None:
        self._proxy._decide(self._exchange, event, error_type)


class _DisconnectWatcher:
    """Cancels the current task when the client disconnects.

    ASGI servers silently drop ``send`` after a disconnect, so without this a
    long generation would run on at D for nobody. For a passthrough request
    the watcher also streams the request body to D (``body()``) and starts
    listening once it is complete.
    """

    def __init__(self, receive: Receive, body_pending: bool = False) -> None:
        self._receive = receive
        self._owner = asyncio.current_task()
        self.body_pending = body_pending
        # Only a passthrough body still being streamed to D needs the watcher to wait.
        self._body_done = asyncio.Event() if body_pending else None
        self.fired = False
        self._task = asyncio.create_task(self._watch())

    async def body(self) -> AsyncIterator[bytes]:
        try:
            while True:
                message = await self._receive()
                if message["type"] == "http.disconnect":
                    self._fire()
                    # Raised, not returned: a body that ends normally gets its chunked terminator,
                    # and D would take a cut upload for a whole one. The client's connection
                    # aborts the one to D instead.
                    raise ClientGone
                chunk = message.get("body", b"")
                if chunk:
                    yield chunk
                if not message.get("more_body", False):
                    return
        finally:
            if self._body_done is not None:
                self._body_done.set()

    async def _watch(self) -> None:
        if self._body_done is not None:
            await self._body_done.wait()
            if self.fired:
                return
        while True:
            message = await self._receive()
            if message["type"] == "http.disconnect":
                self._fire()
                return

    def _fire(self) -> None:
        if not self.fired and self._owner is not None:
            self.fired = True
            self._owner.cancel()

    def stop(self) -> None:
        self._task.cancel()


def _target(scope: Scope) -> str:
    raw_path: bytes | None = scope.get("raw_path")
    path = raw_path.decode("latin-1") if raw_path else scope["path"]
    query: bytes = scope.get("query_string", b"")
    return f"{path}?{query.decode('latin-1')}" if query else path


def _has_body(scope: Scope) -> bool:
    for name, value in scope["headers"]:
        if name == b"content-length":
            return value.strip() not in (b"", b"0")
        if name == b"transfer-encoding":
            return True
    return False


def _header(scope: Scope, wanted: bytes) -> bytes | None:
    for name, value in scope["headers"]:
        if name == wanted:
            return bytes(value)
    return None


def _sized(headers: list[tuple[str, str]], body: bytes) -> list[tuple[str, str]]:
    """Headers for a rewritten body: the client's length no longer applies."""
    out = [(n, v) for n, v in headers if n not in ("content-length", "x-prefiller-host-port")]
    out.append(("content-length", str(len(body))))
    return out


def _event_stream(head: list[tuple[bytes, bytes]]) -> bool:
    return any(
        name == b"content-type" and value.split(b";", 1)[0].strip().lower() == b"text/event-stream"
        for name, value in head
    )


def _encoded(head: list[tuple[bytes, bytes]]) -> bool:
    return any(name == b"content-encoding" and value not in (b"identity", b"") for name, value in head)


def _error_type(body: bytes) -> str | None:
    try:
        return ERROR_DECODER.decode(body).error.type
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
