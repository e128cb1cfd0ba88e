"""The answers the sidecar gives itself, D never seeing the request.

* ``replay``: parameters already handed to a release (P may reuse the blocks:
  D reading them would decode from another request's cache), 409 (410, then
  400, when a proxy in front retries 409: ``sidecar.retries``);
* ``inject``: an injected rejection for load tests (``sidecar.proxy.inject``);
* ``refuse``: the sidecar is shutting down (503), or over its own limits;
* ``too_large``: a body over ``max_body_bytes`` (413), released when its
  parameters can be found and trusted;
* ``over_limit``: above ``limit_concurrency`` (503, connection shed), the body
  read first, at most ``max(8, limit / 4)`` at once, so its blocks are released
  (unread when a proxy in front retries 503: nothing is released behind it).

Each judges the exchange before answering, so a release's ``x-should-retry``
reaches the client.
"""

from __future__ import annotations

import logging

from sidecar import retries
from sidecar.classify import FAILURE_STATUS, Event, NoAnswer
from sidecar.config import Config
from sidecar.decision.judge import Judge
from sidecar.decision.policy import Policy
from sidecar.observability.metrics import ROUTES, Metrics, status_class
from sidecar.proxy.answers import CLOSE, INJECTED, NO_RETRY, send_error
from sidecar.proxy.body import ClientGone, Oversized, read_body
from sidecar.proxy.context import Exchange, RequestContext
from sidecar.proxy.forward import Forwarder
from sidecar.proxy.inspect import Inspector

log = logging.getLogger("sidecar.proxy")

SHUTTING_DOWN = "the sidecar is shutting down"
REPLAY_MESSAGE = (
    "kv_transfer_params were released to the prefill server after an earlier rejection of a "
    "request with them; run the prefill again"
)


class Refusals:
    """The sidecar's own answers (see the module docstring)."""

    def __init__(
        self, config: Config, inspector: Inspector, judge: Judge, forwarder: Forwarder, metrics: Metrics
    ) -> None:
        self._config = config
        self._inspector = inspector
        self._judge = judge
        self._forwarder = forwarder
        self._metrics = metrics
        self.scan_limit = config.max_body_bytes * 4
        # Bodies read at once for requests above limit_concurrency (to release what they name);
        # past this many, such requests are refused unread and P's lease frees their blocks.
        self._over_limit_cap = max(8, config.limit_concurrency // 4)
        self._over_limit_reads = 0
        # The spent-parameters answer is one no proxy in front retries on another pod.
        self._replay_status = retries.replay_status(judge.retried)
        self._over_limit_unread = FAILURE_STATUS[NoAnswer.OVERLOADED] in judge.retried
        self.stopping = False  # set once the drain began: new inspected requests are refused

    async def replay(self, ctx: RequestContext, exchange: Exchange) -> bool:
        """A request naming parameters already released: refused when P frees them.

        The parameters are single-use after a rejection (as with vLLM's own release, 0.21.0+),
        and the caller must prefill again. With a strategy that frees nothing (``off``,
        ``dry-run``) the request is forwarded and only counted. True when answered here.
        """
        if not self._judge.release_frees:
            self._metrics.replays.labels("forwarded").inc()
            log.warning(
                "request reuses parameters of a released request (forwarded: the strategy frees nothing)",
                extra={"request_id": exchange.request_id},
            )
            return False
        status = self._replay_status
        self._metrics.replays.labels("refused").inc()
        self._forwarder.count(exchange.route, status)
        log.warning(
            "request reuses parameters already released to P; refused",
            extra={"request_id": exchange.request_id},
        )
        await send_error(
            ctx.send, status, REPLAY_MESSAGE, exchange.request_id, "kv_transfer_params", (NO_RETRY,)
        )
        return True

    async def inject(self, ctx: RequestContext, exchange: Exchange, status: int) -> None:
        """Answer an injected rejection; D never sees the request (``sidecar.proxy.inject``)."""
        self._forwarder.judged(exchange, Event(failure=NoAnswer.INJECTED, answer=status))
        self._metrics.injected.labels(status_class(status)).inc()
        self._forwarder.count(exchange.route, status)
        message = "rejection injected by kv-release-sidecar (load test)"
        extra = (INJECTED, *exchange.retry_headers())
        await send_error(ctx.send, status, message, exchange.request_id, extra=extra)

    async def refuse(
        self, ctx: RequestContext, exchange: Exchange, failure: NoAnswer, message: str, close: bool = False
    ) -> None:
        """The sidecar answers itself; D never sees the request."""
        self._forwarder.judged(exchange, Event(failure=failure))
        status = FAILURE_STATUS[failure]
        self._forwarder.count(exchange.route, status)
        extra = (*exchange.retry_headers(), *((CLOSE,) if close else ()))
        await send_error(ctx.send, status, message, exchange.request_id, extra=extra)

    async def too_large(self, ctx: RequestContext, body: Oversized, policy: Policy) -> None:
        exchange = self._inspector.oversized(ctx, body, policy)
        # The size the client declared; without one, what was read (all of it, or a lower bound).
        if ctx.declared is not None:
            size = f"{ctx.declared} bytes"
        else:
            size = f"{body.size} bytes" if body.complete else f"more than {body.size} bytes"
        message = f"request body of {size} exceeds the limit of {self._config.max_body_bytes}"
        # Past scan_limit the rest of the body is unread: shed the connection rather than have the
        # server read and discard an unbounded remainder outside limit_concurrency.
        await self.refuse(ctx, exchange, NoAnswer.BODY_TOO_LARGE, message, close=not body.complete)

    async def over_limit(self, ctx: RequestContext, policy: Policy) -> None:
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
                self._forwarder.count(ctx.route, 503)
            await send_error(ctx.send, 503, message, ctx.request_id, extra=(CLOSE,))
            return
        self._over_limit_reads += 1
        try:
            body = await read_body(ctx.receive, self._config.max_body_bytes, self.scan_limit)
        except ClientGone:
            self._metrics.request_counter(ROUTES[ctx.route], "client_gone").inc()
            return
        finally:
            self._over_limit_reads -= 1
        if isinstance(body, Oversized):
            await self.too_large(ctx, body, policy)
            return
        exchange = self._inspector.inspected(ctx, body)
        await self.refuse(ctx, exchange, NoAnswer.OVERLOADED, message, close=True)
