"""Data-parallel ranks' listeners, as llm-d's routing sidecar serves them.

With ``data_parallel_size`` N the sidecar listens on ``port`` .. ``port + N - 1``;
the listener of rank r forwards to D's rank r, ``decode_url``'s port + r (vLLM's
data-parallel ranks each serve their own API port; ``sidecar.app.decode_ranks``
holds each rank's client and D's state). ``RankFront`` wraps the proxy app once
per listener: it names the rank in the request's scope, and with
llm-d's answers (``sidecar.proxy.answers``) serves llm-d's ``GET /health`` (and ``HEAD``, as Go's
router matches it).

Rank 0's listener honours llm-d's deprecated ``x-data-parallel-host-port`` as
llm-d does: on the routes llm-d intercepts (``POST``), a value equal to
``POD_IP:port`` of one of the listeners (Go's ``net.JoinHostPort(POD_IP, port)``,
so ``:port`` when ``pod_ip`` is empty, ``[addr]:port`` for IPv6; compared as
text) sends the request to that rank; any other value is answered 400 with an
empty body. Unlike llm-d, the 400 comes before the prefill leg, so P does no
work for it. Other listeners and other routes ignore the header, as llm-d's do.
``x-data-parallel-rank`` is passed on to P and D unchanged, as llm-d passes it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from urllib.parse import urlsplit

from sidecar.asgi import Receive, Scope, Send
from sidecar.config import Config
from sidecar.proxy.answers import STYLES

#: The scope key naming the request's data-parallel rank (0 when absent).
RANK = "kvr.data_parallel_rank"
HOST_PORT_HEADER = b"x-data-parallel-host-port"
#: The routes llm-d's sidecar intercepts (the header picks a rank on these only).
LLMD_ROUTES = frozenset(
    {"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages", "/inference/v1/generate"}
)
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


def rank_url(url: str, rank: int) -> str:
    """``url`` with its port moved up by ``rank``."""
    if not rank:
        return url
    parts = urlsplit(url)
    port = (parts.port or (443 if parts.scheme == "https" else 80)) + rank
    host = f"[{parts.hostname}]" if parts.hostname and ":" in parts.hostname else parts.hostname
    return parts._replace(netloc=f"{host}:{port}").geturl()


def host_port(host: str, port: int) -> str:
    """Go's ``net.JoinHostPort``: ``host:port``, ``[host]:port`` when ``host`` has a colon."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class RankFront:
    """The ASGI app of one rank's listener (see the module docstring)."""

    def __init__(self, app: ASGIApp, rank: int, config: Config) -> None:
        self.app, self.rank = app, rank
        answers = STYLES[config.answers]
        self._health = answers.serves_health
        # llm-d's rank 0 server always keeps the table, a single rank included.
        routes = rank == 0 and (config.data_parallel_size > 1 or answers.keeps_rank_table)
        ranks = range(config.data_parallel_size) if routes else range(0)
        self._ranks = {host_port(config.pod_ip, config.port + r).encode("latin-1"): r for r in ranks}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            if self._health and scope["method"] in ("GET", "HEAD") and scope["path"] == "/health":
                await _empty(send, 200)
                return
            rank = self._named_rank(scope) if self._ranks else self.rank
            if rank is None:
                await _empty(send, 400)
                return
            scope[RANK] = rank
        await self.app(scope, receive, send)

    def _named_rank(self, scope: Scope) -> int | None:
        if scope["method"] != "POST" or scope["path"] not in LLMD_ROUTES:
            return 0
        value = next((v for n, v in scope["headers"] if n == HOST_PORT_HEADER), b"").strip()
        if not value:  # Go's Header.Get: absent and empty are the same
            return 0
        return self._ranks.get(value)


async def _empty(send: Send, status: int) -> None:
    await send({"type": "http.response.start", "status": status, "headers": [(b"content-length", b"0")]})
    await send({"type": "http.response.body", "body": b"", "more_body": False})
