"""Making an ``Exchange``: the three ways a request's parameters become known.

* ``inspected``: sidecar mode, from the request body (only ``stream``, ``n``,
  ``request_id`` and ``kv_transfer_params`` are decoded; the bytes go to D
  untouched);
* ``prefilled``: router mode, from P's answer to the prefill leg;
* ``oversized``: a body over ``max_body_bytes``, from the parameters a router
  appended as the body's last member (``sidecar.proxy.body.tail_params``).

Every one checks the parameters once (``sidecar.params.check``) and, in
sidecar mode, the trust setting: untrusted parameters are forwarded but
never released. The raw parameters are kept only for strategies that hand
them on (``Releaser.keeps_raw``).
"""

from __future__ import annotations

import logging
import time

import msgspec

from sidecar import params as params_mod
from sidecar.decision.policy import SIDECAR, Policy
from sidecar.observability.metrics import Metrics
from sidecar.proxy.body import Oversized, tail_params
from sidecar.proxy.context import Exchange, RequestContext
from sidecar.proxy.trust import Trust
from sidecar.proxy.usage import UsageRewriter
from sidecar.wire import VIEW_DECODER, lax_bool

log = logging.getLogger("sidecar.proxy")


class Inspector:
    """Builds exchanges (see the module docstring)."""

    def __init__(self, metrics: Metrics, trust: Trust, keeps_raw: bool) -> None:
        self._metrics = metrics
        self._trust = trust
        self._keeps_raw = keeps_raw

    def plain(self, ctx: RequestContext, stream: bool, policy: Policy = SIDECAR) -> Exchange:
        """An exchange with nothing to release (no parameters, or not a JSON object)."""
        assert ctx.route is not None
        return Exchange(ctx.request_id, ctx.route, None, stream, time.monotonic(), policy)

    def inspected(self, ctx: RequestContext, body: bytes) -> Exchange:
        assert ctx.route is not None
        try:
            view = VIEW_DECODER.decode(body)
        except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
            # Not a JSON object: forwarded as it is, D answers it; nothing to release.
            self._metrics.ineligible.labels(params_mod.Ineligible.NOT_JSON).inc()
            return self.plain(ctx, stream=False)
        raw = bytes(view.kv_transfer_params)
        params = self._eligible(raw, ctx.request_id)
        if params is not None and not self._trust.client_params:
            # pd-sidecar, as llm-d: only the parameters P returned to the router's own leg release.
            self._metrics.ineligible.labels(params_mod.Ineligible.CLIENT_PARAMS_DROPPED).inc()
            params = None
        if params is not None and not self._trust.trusted(ctx.headers_read, ctx.request_id, raw):
            # Forwarded unchanged, never released: anyone could name another tenant's blocks.
            self._metrics.ineligible.labels(params_mod.Ineligible.UNTRUSTED).inc()
            params = None
        return Exchange(
            ctx.request_id,
            ctx.route,
            params,
            lax_bool(view.stream) is True,
            time.monotonic(),
            SIDECAR,
            raw_params=self._raw(raw, params),
            body_request_id=view.request_id if isinstance(view.request_id, str) else None,
            data_parallel_rank=ctx.dp_rank,
            request_id_generated=ctx.generated,
            vouched=params is not None and self._trust.vouches,
        )

    def prefilled(
        self,
        ctx: RequestContext,
        raw: bytes | None,
        rewriter: UsageRewriter | None,
        policy: Policy,
        prefilled_at: float | None = None,
    ) -> Exchange:
        """Router mode: P's own parameters (never the client's) as the JSON the decode leg carries,
        or None; ``prefilled_at`` is when P answered (the judge skips a release P's lease has made
        pointless)."""
        assert ctx.route is not None
        found = params_mod.check(raw).params if raw else None
        return Exchange(
            ctx.request_id,
            ctx.route,
            found,
            rewriter.stream if rewriter is not None else False,
            time.monotonic(),
            policy,
            raw_params=self._raw(raw, found),
            data_parallel_rank=ctx.dp_rank,
            rewriter=rewriter,
            prefilled_at=prefilled_at,
            vouched=True,  # P's own answer to the router's prefill leg
        )

    def oversized(self, ctx: RequestContext, body: Oversized, policy: Policy) -> Exchange:
        """A body over the cap: the parameters a router appended last, if trusted and ``policy``
        reads the client's parameters (sidecar mode)."""
        assert ctx.route is not None
        raw = tail_params(body.tail) if body.complete else None
        found = params_mod.check(raw).params if raw else None
        if found is not None and not (policy.client_params and self._trust.client_params):
            found = None  # router mode drops client parameters: they could name any P's blocks
        if found is not None and raw and not self._trust.trusted(ctx.headers_read, ctx.request_id, raw):
            self._metrics.ineligible.labels(params_mod.Ineligible.UNTRUSTED).inc()
            found = None
        exchange = self.plain(ctx, stream=False)
        exchange.params, exchange.raw_params = found, self._raw(raw, found)
        exchange.request_id_generated = ctx.generated
        exchange.vouched = found is not None and self._trust.vouches
        return exchange

    def _eligible(self, raw: bytes, request_id: str) -> params_mod.ReleaseParams | None:
        eligibility = params_mod.check(raw)
        reason = eligibility.reason
        if reason is not None and reason is not params_mod.Ineligible.NO_PARAMS:
            self._metrics.ineligible.labels(reason.value).inc()
            if reason is params_mod.Ineligible.MALFORMED:
                log.warning(
                    "malformed kv_transfer_params, will not release",
                    extra={"request_id": request_id, "detail": eligibility.detail},
                )
        return eligibility.params

    def _raw(self, raw: bytes | None, params: params_mod.ReleaseParams | None) -> bytes | None:
        """The parameters as sent, kept only when released through a strategy that hands them on."""
        return raw if raw is not None and params is not None and self._keeps_raw else None
