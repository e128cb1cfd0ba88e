"""Data-parallel ranks, as llm-d's routing sidecar serves them.

With ``data_parallel_size`` N the sidecar listens on ``port`` .. ``port + N - 1``;
the listener of rank r forwards to D's rank r, ``decode_url``'s port + r (vLLM's
data-parallel ranks each serve their own API port). ``RankFront`` wraps the
proxy app once per listener: it names the rank in the request's scope, serves
llm-d's ``GET /health`` (and ``HEAD``, as Go's router matches it) with
``answers = "llm-d"``, and on rank 0 honours llm-d's
deprecated ``x-data-parallel-host-port`` header (a listener's ``host:port``:
that rank; any other port: 400, as llm-d answers). ``x-data-parallel-rank`` is
passed on to P and D unchanged, as llm-d passes it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable
from urllib.parse import urlsplit

from sidecar.allowlist import split_host_port
from sidecar.asgi import Receive, Scope, Send
from sidecar.config import Config
from sidecar.proxy import Proxy, ProxyParts
from sidecar.upstream import Client

#: The scope key naming the request's data-parallel rank (0 when absent).
RANK = "kvr.data_parallel_rank"
HOST_PORT_HEADER = b"x-data-parallel-host-port"
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


def rank_url(url: str, rank: int) -> str:
    """``url`` with its port moved up by ``rank``."""
    if not rank:
        return url
    parts = urlsplit(url)
    port = (parts.port or (443 if parts.scheme == "https" else 80)) + rank
    host = f"[{parts.hostname}]" if parts.hostname and ":" in parts.hostname else parts.hostname
    return parts._replace(netloc=f"{host}:{port}").geturl()


class RankFront:
    """The ASGI app of one rank's listener (see the module docstring)."""

    def __init__(self, app: ASGIApp, rank: int, config: Config) -> None:
        self.app, self.rank = app, rank
        self._health = config.answers == "llm-d"
        self._ports = range(config.port, config.port + config.data_parallel_size)
        self._routes = rank == 0 and config.data_parallel_size > 1

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            if self._health and scope["method"] in ("GET", "HEAD") and scope["path"] == "/health":
                await _empty(send, 200)
                return
            rank = self._named_rank(scope) if self._routes else self.rank
            if rank is None:
                await _empty(send, 400)
                return
            scope[RANK] = rank
        await self.app(scope, receive, send)

    def _named_rank(self, scope: Scope) -> int | None:
        value = next((v for n, v in scope["headers"] if n == HOST_PORT_HEADER), None)
        if value is None:
            return 0
        target = split_host_port(value.decode("latin-1").strip())
        if target is None or target[1] not in self._ports:
            return None
        return target[1] - self._ports.start


async def _empty(send: Send, status: int) -> None:
    await send({"type": "http.response.start", "status": status, "headers": [(b"content-length", b"0")]})
    await send({"type": "http.response.body", "body": b"", "more_body": False})


async def rank_proxies(
    config: Config, parts: ProxyParts, connect: Callable[[Config, int], Client]
) -> list[Proxy]:
    """A proxy for each rank above 0, sharing ``parts`` but for its own client to D's rank."""
    proxies = []
    for rank in range(1, config.data_parallel_size):
        upstream = connect(config, rank)
        await upstream.start()
        proxies.append(Proxy(config, dataclasses.replace(parts, upstream=upstream)))
    return proxies
