"""Router mode, one request: the prefill leg on P, then the decode leg on D with P's parameters.

The decode leg goes through the proxy's admission step (``Admission.admit``:
draining, injection, then D) like any inspected request, with the router's
``Policy``: the judge then releases what the router aborted itself (header
timeout, client gone) and, with ``decode_releases``, leaves D's answers to
the decode sidecar. A failing P leg is tried once on another P; with none
left the answer is 503, or with ``decode_only_fallback`` D prefills itself
(also the only path for ``n > 1``: vLLM's D reads P's blocks once per choice,
and P frees them after the first choice's notifications while the others may
still read; docs/llm-d.md). ``Admission`` is all router mode uses of the
proxy's workings; the app hands router mode the config, the metrics, the
tracing and the signing of what it forwards itself.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

import msgspec

from sidecar.asgi import DISCONNECT_HUB
from sidecar.config import Config
from sidecar.decision.policy import Policy, router_policy
from sidecar.observability.metrics import Metrics
from sidecar.observability.tracing import OFF, Tracing
from sidecar.params import Ineligible
from sidecar.proxy.answers import STYLES, send_error, send_raw
from sidecar.proxy.context import Exchange, RequestContext
from sidecar.proxy.disconnect import DisconnectWatcher
from sidecar.proxy.usage import UsageRewriter
from sidecar.router.bodies import decode_body, prefill_body, sized, with_params
from sidecar.router.pool import AnswerTooLarge, PrefillPool, PrefillResult, RouterError
from sidecar.upstream import UpstreamError
from sidecar.wire import lax_bool

log = logging.getLogger("sidecar.router")

_ENCODER = msgspec.json.Encoder()
RETRIED = frozenset({502, 503, 504})  # P's answers a prefill leg is retried on, as llm-d retries


class Admission(Protocol):
    """The proxy's admission step, all router mode uses of the proxy's workings
    (``sidecar.proxy.handler.Proxy``): the exchanges it judges, and the one step to D."""

    async def admit(
        self,
        ctx: RequestContext,
        exchange: Exchange,
        headers: list[tuple[str, str]],
        body: bytes,
        watcher: DisconnectWatcher | None = None,
    ) -> None:
        """Refused while draining, an injected rejection, else to D: answered and judged."""

    async def alone(
        self, ctx: RequestContext, stream: bool, headers: list[tuple[str, str]], body: bytes
    ) -> None:
        """To D without parameters (D prefills itself, or answers a body that is no JSON object)."""

    def prefilled(
        self,
        ctx: RequestContext,
        raw: bytes | None,
        rewriter: UsageRewriter | None,
        policy: Policy,
        answered: float | None,
    ) -> Exchange:
        """The decode leg's exchange, with P's own parameters as JSON (``raw``)."""

    def abandoned(self, exchange: Exchange) -> None:
        """The client left before the request went to D: released, counted as gone."""

    def unsent(self, exchange: Exchange) -> None:
        """P's answer was over ``prefill_answer_limit``: no decode leg goes to D; released."""


#: Headers that vouch for the parameters the decode leg carries (``sidecar.proxy.trust.Trust.outgoing``).
Sign = Callable[[str, bytes], list[tuple[str, str]]]


class Router:
    """Drives router-mode requests (see the module docstring)."""

    def __init__(
        self,
        proxy: Admission,
        pool: PrefillPool,
        config: Config,
        metrics: Metrics,
        sign: Sign,
        tracing: Tracing = OFF,
    ) -> None:
        self._proxy = proxy  # the proxy's admission step: all router mode uses of the proxy
        self.pool = pool
        self.config, self.metrics, self.tracing, self._sign = config, metrics, tracing, sign
        self.answers = STYLES[config.answers]  # the style of the sidecar's own answers, picked once
        self.policy = router_policy(config.decode_releases)

    async def close(self) -> None:
        await self.pool.close()

    def routes(self, ctx: RequestContext) -> bool:
        """This request takes the router's path: a static P pool, or llm-d's prefiller header
        (unless ``prefill_leg = skip``, or the header is empty: D alone serves it, as llm-d)."""
        named = bool(ctx.prefiller and ctx.prefiller.strip()) and self.config.prefill_leg != "skip"
        return bool(self.pool.static) or named

    async def route(self, ctx: RequestContext, body: bytes) -> None:
        if self.config.prefill_leg == "refuse" and ctx.prefiller is not None:
            assert ctx.route is not None
            self.metrics.answered(ctx.route, 501)
            message = "x-prefiller-host-port: the P/D protocol set by --kv-connector is not implemented here"
            await send_error(ctx.send, 501, message, ctx.request_id, "x-prefiller-host-port")
            return
        try:
            request = msgspec.json.decode(body)
        except (msgspec.DecodeError, RecursionError):
            request = None
        if not isinstance(request, dict):  # D answers a body that is not a JSON object
            await self._proxy.alone(ctx, False, ctx.headers, body)
            return
        if request.pop("kv_transfer_params", None) is not None:
            self.metrics.ineligible.labels(Ineligible.CLIENT_PARAMS_DROPPED).inc()
        n = request.get("n")
        if isinstance(n, int) and not isinstance(n, bool) and n > 1:
            await self._multi_choice(ctx, request)
            return
        try:
            candidates = await self.pool.candidates(ctx.prefiller)
        except RouterError as exc:
            assert ctx.route is not None
            self.metrics.answered(ctx.route, exc.status)
            if exc.refused:
                self.metrics.prefill_refused.labels(exc.refused).inc()
            await self.answers.prefill_refused(ctx.send, exc.status, str(exc), ctx.request_id, exc.param)
            return
        watcher = DisconnectWatcher(ctx.receive, hub=ctx.scope.get(DISCONNECT_HUB), deferred=True)
        try:
            prefilled = await self._prefill_leg(ctx, candidates, request, watcher)
        except asyncio.CancelledError:
            watcher.stop()  # cancelled from outside (shutdown past drain_timeout): no watcher left behind
            raise
        except RouterError as exc:
            watcher.stop()
            await self._prefill_failed(ctx, request, exc)
            return
        if prefilled is None:  # the client left during the prefill leg (released there)
            watcher.stop()
            return
        await self._decode_leg(ctx, request, prefilled, watcher)

    async def _decode_leg(
        self,
        ctx: RequestContext,
        request: dict[str, Any],
        prefilled: PrefillResult,
        watcher: DisconnectWatcher,
    ) -> None:
        proxy = self._proxy
        rewriter = UsageRewriter(prefilled.cached_tokens, lax_bool(request.get("stream")) is True)
        params = prefilled.params
        raw = _ENCODER.encode(params) if params is not None else None  # once: sent, checked, signed
        kept = raw if params else None  # an empty object names nothing: neither checked nor signed
        exchange = proxy.prefilled(ctx, kept, rewriter, self.policy, prefilled.answered)
        decode = decode_body(request, None) if raw is None else with_params(request, raw)
        signed = self._sign(ctx.request_id, kept) if kept else []
        await proxy.admit(ctx, exchange, sized(ctx.headers, decode) + signed, decode, watcher)

    async def _prefill_leg(
        self,
        ctx: RequestContext,
        candidates: list[str],
        request: dict[str, Any],
        watcher: DisconnectWatcher,
    ) -> PrefillResult | None:
        """Try one P, then one other; None when the client left meanwhile (P's blocks are released).

        The leg runs in the request's own task (no task of its own per request) under a deferred
        watcher: a client that leaves does not cut it, P still answers (bounded by
        ``prefill_timeout``) and what it kept is released; a cancellation from outside
        (shutdown) cuts it."""
        try:
            result = await self._try_prefill(ctx, candidates, request)
        except Exception as exc:
            if not watcher.fired:
                raise
            if isinstance(exc, AnswerTooLarge):
                self._release_unsent(ctx, exc)
            return None
        if watcher.fired:  # the client went away: release what P kept for it
            proxy = self._proxy
            proxy.abandoned(proxy.prefilled(ctx, _raw(result.params), None, self.policy, result.answered))
            return None
        watcher.arm()
        return result

    def _release_unsent(self, ctx: RequestContext, exc: AnswerTooLarge) -> None:
        """P's answer was over ``prefill_answer_limit``: no decode leg is sent for it, so D never
        reads the blocks P kept; release them when their parameters were read at its end."""
        if exc.params is None:
            self.metrics.ineligible.labels(Ineligible.PREFILL_ANSWER_UNREAD).inc()
            return
        self._proxy.unsent(self._proxy.prefilled(ctx, _raw(exc.params), None, self.policy, exc.answered))

    async def _try_prefill(
        self, ctx: RequestContext, candidates: list[str], request: dict[str, Any]
    ) -> PrefillResult:
        """One P, then one other; with ``answers = "llm-d"`` one P only, whose last answer is the client's."""
        assert ctx.route is not None
        route = ctx.route
        body = prefill_body(request, route)
        p_headers = sized(ctx.headers, body)  # as prefill_headers(), with the new length
        llmd = self.answers.one_prefill
        last: Exception | None = None
        for url in candidates[: 1 if llmd else 2]:  # a failing P leg is tried once on another P
            try:
                return await self._attempts(url, route, body, p_headers)
            except RouterError as exc:
                if exc.status < 500 or llmd or isinstance(exc, AnswerTooLarge):
                    raise  # P's own answer, passed to the client as it is
                last = exc
            except UpstreamError as exc:
                if llmd:
                    raise RouterError(502, f"prefill server {url} failed: {exc}") from exc
                last = exc
            self.pool.mark_failed(url)
            log.warning("prefill leg failed", extra={"prefill": url, "detail": str(last)})
        raise RouterError(503, f"no prefill server available ({last or 'none configured'})")

    async def _attempts(
        self, url: str, route: str, body: bytes, headers: list[tuple[str, str]]
    ) -> PrefillResult:
        """The prefill leg on ``url``, retried ``prefill_max_retries`` times while P answers 502, 503
        or 504 or cannot be reached, ``prefill_retry_backoff`` apart; raises the last failure."""
        retries = self.config.prefill_max_retries
        for attempt in range(retries + 1):
            started = time.monotonic()
            try:
                result = await self._prefill(url, route, body, headers)
            except RouterError as exc:
                if exc.status >= 500:
                    self.metrics.leg_failures.labels("prefill", f"status_{exc.status // 100}xx").inc()
                if exc.status not in RETRIED or attempt == retries or isinstance(exc, AnswerTooLarge):
                    raise
            except UpstreamError as exc:
                self.metrics.leg_failures.labels("prefill", exc.failure.value).inc()
                if attempt == retries:
                    raise
            else:
                self.metrics.leg_latency_for("prefill").observe(time.monotonic() - started)
                return result
            await asyncio.sleep(self.config.prefill_retry_backoff)
        raise AssertionError("unreachable")  # pragma: no cover - the loop returns or raises

    async def _prefill(
        self, url: str, route: str, body: bytes, headers: list[tuple[str, str]]
    ) -> PrefillResult:
        if self.tracing.enabled:
            with self.tracing.leg_span("kvr.prefill", "POST", url + route, headers) as leg:
                return await self.pool.prefill(url, route, body, leg.headers)
        return await self.pool.prefill(url, route, body, headers)

    async def _prefill_failed(self, ctx: RequestContext, request: dict[str, Any], exc: RouterError) -> None:
        assert ctx.route is not None
        if isinstance(exc, AnswerTooLarge):
            self._release_unsent(ctx, exc)
        if exc.body is not None:  # P's own answer to a bad request
            self.metrics.answered(ctx.route, exc.status)
            await send_raw(ctx.send, exc.status, exc.body, ctx.request_id)
            return
        if self.config.decode_only_fallback:
            self.metrics.leg_failures.labels("prefill", "decode_only_fallback").inc()
            await self._decode_only(ctx, request)
            return
        self.metrics.answered(ctx.route, exc.status)
        await send_error(ctx.send, exc.status, str(exc), ctx.request_id)

    async def _multi_choice(self, ctx: RequestContext, request: dict[str, Any]) -> None:
        """``n > 1``: never on the P/D path (D reads P's blocks once per choice, docs/llm-d.md)."""
        if self.config.decode_only_fallback:
            await self._decode_only(ctx, request)
            return
        assert ctx.route is not None
        self.metrics.answered(ctx.route, 400)
        message = "n > 1 is not supported on the prefill/decode path (set decode_only_fallback to allow it)"
        await send_error(ctx.send, 400, message, ctx.request_id, "n")

    async def _decode_only(self, ctx: RequestContext, request: dict[str, Any]) -> None:
        """D prefills itself: the request goes to D without kv_transfer_params."""
        body = decode_body(request, None)
        await self._proxy.alone(ctx, lax_bool(request.get("stream")) is True, sized(ctx.headers, body), body)


def _raw(params: dict[str, Any] | None) -> bytes | None:
    """P's parameters as JSON, for the judge (None when they name nothing)."""
    return _ENCODER.encode(params) if params else None
