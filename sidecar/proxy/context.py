"""One request as the proxy holds it, read once: its head, its body, and its exchange with D.

``RequestContext`` is built once per request from the ASGI scope: the headers
that go to D, the request id (propagated, or made up here), the inspected
route, and the few request headers the proxy reads (the data-parallel rank,
llm-d's prefiller header, the trust and injection headers, the body's
framing), so nothing parses ``scope`` again.

An inspected body is read whole up to ``max_body_bytes`` (``read_body``; the
original bytes are forwarded untouched). Above the cap the sidecar answers
413, but P's blocks were still pinned for this request, so the rest of the
body is read and discarded (bounded by ``scan_limit``) keeping only a tail
window, where routers append ``kv_transfer_params`` as the last key:
``tail_params`` finds it there when it is the top-level object's last member.

``Exchange`` is one inspected request on its way to D, and ``Inspector`` its
only maker, in one of three ways:

* ``inspected``: sidecar mode, from the request body (only ``stream``, ``n``,
  ``request_id`` and ``kv_transfer_params`` are decoded; the bytes go to D
  untouched);
* ``prefilled``: router mode, from P's answer to the prefill leg;
* ``oversized``: a body over ``max_body_bytes``, from the parameters a router
  appended as the body's last member (``tail_params``).

Every one checks the parameters once (``sidecar.params.check``) and, in
sidecar mode, the trust setting: untrusted parameters are forwarded but
never released. The raw parameters are kept only for strategies that hand
them on (``Releaser.keeps_raw``).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec

from sidecar import params as params_mod
from sidecar.asgi import Message, Receive, Scope, Send
from sidecar.decision.judge import Judged
from sidecar.decision.policy import SIDECAR, Policy
from sidecar.exceptions import SidecarError
from sidecar.observability.metrics import ROUTES, Metrics
from sidecar.params import ReleaseParams
from sidecar.proxy.answers import NO_RETRY, Header
from sidecar.proxy.headers import DATA_PARALLEL_RANK, data_parallel_rank, request_headers
from sidecar.proxy.trust import SIGNATURE_HEADER, TOKEN_HEADER, Trust
from sidecar.wire import VIEW_DECODER, lax_bool

if TYPE_CHECKING:
    from sidecar.proxy.usage import UsageRewriter
    from sidecar.upstream import Sent

log = logging.getLogger("sidecar.proxy")

PREFILLER_HEADER = b"x-prefiller-host-port"  # llm-d's routing sidecar names P per request
INJECT_HEADER = b"x-kvr-inject-reject"  # a rejection to inject (``sidecar.proxy.handler.Injector``)
_READ = frozenset({DATA_PARALLEL_RANK, PREFILLER_HEADER, INJECT_HEADER, TOKEN_HEADER, SIGNATURE_HEADER})
_FRAMING = frozenset({b"content-length", b"transfer-encoding"})
TAIL_WINDOW = 256 * 1024
_KEY = b'"kv_transfer_params"'


@dataclass(slots=True)
class RequestContext:
    """What the proxy needs of one request, read from the scope once."""

    scope: Scope
    receive: Receive
    send: Send
    route: str | None  # an inspected completion route, else None (passthrough)
    headers: list[tuple[str, str]]  # for D: hop-by-hop headers gone, x-request-id present
    request_id: str
    generated: bool  # the sidecar made the id up: no other server knows it
    headers_read: dict[bytes, bytes]  # the request headers the proxy reads (first of each; P's: all, joined)
    has_body: bool
    dp_rank: int | None
    started: float = field(default_factory=time.monotonic)
    declared: int | None = None  # the body's size as Content-Length declares it (None: chunked, or none)

    @classmethod
    def of(cls, scope: Scope, receive: Receive, send: Send) -> RequestContext:
        path: str = scope["path"]
        route = path if scope["method"] == "POST" and path in ROUTES else None
        raw: list[tuple[bytes, bytes]] = scope["headers"]
        headers, request_id, generated = request_headers(raw)
        headers_read: dict[bytes, bytes] = {}
        framing: tuple[bytes, bytes] | None = None
        for name, value in raw:
            if name == PREFILLER_HEADER and name in headers_read:  # every line counts, as in llm-d
                headers_read[name] += b"," + bytes(value)
            elif name in _READ:
                headers_read.setdefault(name, bytes(value))
            elif framing is None and name in _FRAMING:
                framing = (name, value)
        rank = headers_read.get(DATA_PARALLEL_RANK)
        return cls(
            scope=scope,
            receive=receive,
            send=send,
            route=route,
            headers=headers,
            request_id=request_id,
            generated=generated,
            headers_read=headers_read,
            has_body=_has_body(framing),
            dp_rank=data_parallel_rank([(DATA_PARALLEL_RANK, rank)]) if rank is not None else None,
            declared=_declared(framing),
        )

    @property
    def method(self) -> str:
        method: str = self.scope["method"]
        return method

    @property
    def target(self) -> str:
        """The request's path and query as the client sent them."""
        raw_path: bytes | None = self.scope.get("raw_path")
        path = raw_path.decode("latin-1") if raw_path else self.scope["path"]
        query: bytes = self.scope.get("query_string", b"")
        return f"{path}?{query.decode('latin-1')}" if query else path

    @property
    def prefiller(self) -> bytes | None:
        return self.headers_read.get(PREFILLER_HEADER)


def _declared(framing: tuple[bytes, bytes] | None) -> int | None:
    """The size a ``Content-Length`` framing declares (the server checked its form)."""
    if framing is None or framing[0] != b"content-length" or not framing[1].strip().isdigit():
        return None
    return int(framing[1])


def _has_body(framing: tuple[bytes, bytes] | None) -> bool:
    if framing is None:
        return False
    name, value = framing
    return name == b"transfer-encoding" or value.strip() not in (b"", b"0")


# --- the body ----------------------------------------------------------------------------------


class ClientGone(SidecarError):
    """The client disconnected before its body was complete."""


@dataclass(slots=True)
class Oversized:
    """A body over the cap: its size seen so far and the kept tail."""

    size: int
    tail: bytes
    complete: bool  # the whole body was read (within scan_limit)


async def read_body(receive: Receive, cap: int, scan_limit: int) -> bytes | Oversized:
    """The whole body, or ``Oversized`` when it exceeds ``cap``. Raises ``ClientGone``."""
    parts: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        chunk: bytes = message.get("body", b"")
        size += len(chunk)
        more = message.get("more_body", False)
        if size > cap:
            return await _drain(receive, b"".join(parts) + chunk, size, more, scan_limit)
        if chunk:
            parts.append(chunk)
        if not more:
            return parts[0] if len(parts) == 1 else b"".join(parts)


async def _drain(receive: Receive, tail: bytes, size: int, more: bool, scan_limit: int) -> Oversized:
    tail = tail[-TAIL_WINDOW:]
    while more and size <= scan_limit:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        chunk = message.get("body", b"")
        size += len(chunk)
        tail = (tail + chunk)[-TAIL_WINDOW:]
        more = message.get("more_body", False)
    return Oversized(size=size, tail=tail, complete=not more)


def tail_params(tail: bytes) -> bytes | None:
    """Raw JSON (the bytes as sent) of a top-level, last-member ``kv_transfer_params`` in a body's tail.

    The member counts only when nothing but white space and the closing brace
    of the body follows its value, which makes it a member of the outermost
    object (a JSON string cannot contain the unescaped key).
    """
    index = tail.rfind(_KEY)
    if index <= 0:  # at 0 nothing shows it opens a key rather than ends a string
        return None
    backslashes = len(tail[:index]) - len(tail[:index].rstrip(b"\\"))
    if backslashes % 2:  # an escaped quote inside a string or key, not the key itself
        return None
    text = tail[index + len(_KEY) :].decode("utf-8", "surrogateescape")  # bad UTF-8: malformed, as in a body
    rest = text.lstrip()
    if not rest.startswith(":"):
        return None
    rest = rest[1:].lstrip()
    try:
        value, end = json.JSONDecoder().raw_decode(rest)
    except (ValueError, RecursionError):
        return None
    if rest[end:].strip() != "}" or not isinstance(value, dict):
        return None
    # The value's bytes exactly as sent (surrogateescape round-trips them): a router's HMAC
    # covers these bytes, so the trust check sees what the signer signed.
    return rest[:end].encode("utf-8", "surrogateescape")


# --- the exchange ------------------------------------------------------------------------------


@dataclass(slots=True)
class Exchange:
    """One inspected request on its way through the proxy."""

    request_id: str
    route: str
    params: ReleaseParams | None
    stream: bool
    started: float
    policy: Policy  # sidecar or router mode: how the judge reads this exchange's fate
    raw_params: bytes | None = None  # kv_transfer_params as received (for strategies that hand them on)
    body_request_id: str | None = None  # the body's request_id field, if a string
    data_parallel_rank: int | None = None  # the request's X-data-parallel-rank, if valid
    request_id_generated: bool = False  # the sidecar made the X-Request-Id up; P never saw it
    rewriter: UsageRewriter | None = None  # router mode: corrects cached_tokens
    vouched: bool = False  # the parameters are P's own (P's answer, or the router hop vouched for them)
    prefilled_at: float | None = None  # router mode: when P's answer arrived (P's lease began)
    sent: Sent | None = None  # learns whether the request reached D's socket
    responded: bool = False  # http.response.start was sent (set by ``responding`` only)
    judged: Judged | None = None  # what the judge made of it (at most once)

    @property
    def key(self) -> tuple[str, str]:
        """The parameters' identity: (P engine, the id P knows the request by)."""
        params = self.params
        assert params is not None
        return (params.remote_engine_id, params.remote_request_id or self.request_id)

    @property
    def decided(self) -> bool:
        return self.judged is not None

    @property
    def spent(self) -> bool:
        """Its parameters went to a release that frees them: an error answer says
        x-should-retry: false (a retry with them would be refused with 409)."""
        return self.judged is not None and self.judged.spent

    def retry_headers(self) -> tuple[Header, ...]:
        return (NO_RETRY,) if self.spent else ()

    def responding(self, send: Send) -> Send:
        """``send`` that marks this exchange ``responded`` as the response starts: the one place
        that does, so no answer goes out unmarked (as starlette's ``ServerErrorMiddleware``
        tracks ``response_started`` in one wrapper)."""

        async def send_marked(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.responded = True
            await send(message)

        return send_marked


class Inspector:
    """Makes exchanges: the only maker of one (see the module docstring)."""

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
