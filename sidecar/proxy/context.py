"""One request as the proxy holds it: its context, read once, and its exchange with D.

``RequestContext`` is built once per request from the ASGI scope: the headers
that go to D, the request id (propagated, or made up here), the inspected
route, and the few request headers the proxy reads (the data-parallel rank,
llm-d's prefiller header, the trust and injection headers, the body's
framing), so nothing parses ``scope`` again. ``Exchange`` is one inspected
request on its way to D; only ``sidecar.proxy.inspect`` makes one.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from sidecar.asgi import Message, Receive, Scope, Send
from sidecar.decision.judge import Judged
from sidecar.decision.policy import Policy
from sidecar.observability.metrics import ROUTES
from sidecar.params import ReleaseParams
from sidecar.proxy.answers import NO_RETRY, Header
from sidecar.proxy.headers import DATA_PARALLEL_RANK, data_parallel_rank, request_headers
from sidecar.proxy.inject import HEADER as INJECT_HEADER
from sidecar.proxy.trust import SIGNATURE_HEADER, TOKEN_HEADER

if TYPE_CHECKING:
    from sidecar.proxy.usage import UsageRewriter
    from sidecar.upstream import Sent

PREFILLER_HEADER = b"x-prefiller-host-port"  # llm-d's routing sidecar names P per request
_READ = frozenset({DATA_PARALLEL_RANK, PREFILLER_HEADER, INJECT_HEADER, TOKEN_HEADER, SIGNATURE_HEADER})
_FRAMING = frozenset({b"content-length", b"transfer-encoding"})


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
