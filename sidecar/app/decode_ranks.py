"""D's data-parallel ranks above 0: each rank's proxy, its client to D, and D's state there.

vLLM's data-parallel ranks each run their own API server and engine core
(``--data-parallel-rank``, one port per rank), and one rank's engine can die
while the others still answer. So each rank's D is probed on its own port as
rank 0's is (``sidecar.decode.state``), and the judge of a request on rank r
reads rank r's D: whether its
engine can release P's blocks itself. D's vLLM release is read per rank too,
rank 0's standing in until rank r's answered (every rank runs the same
build). ``/readyz`` lists each rank's D (``decode_rank_1``, ...) beside rank
0's (``decode``): the pod is ready only when every rank's D answers
``GET /health`` with 200.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from sidecar.classify import NoAnswer
from sidecar.config import Config
from sidecar.decision.judge import DecodeWatch
from sidecar.decode.state import DecodeState
from sidecar.proxy import Proxy, ProxyParts
from sidecar.upstream import Client

Connect = Callable[[Config, int, "int | None"], Client]  # (config, rank, pool size) -> client to D


class RankDecode:
    """``DecodeWatch`` for one rank's judge: that rank's D state."""

    def __init__(self, state: DecodeState, rank0: DecodeWatch) -> None:
        self._state, self._rank0 = state, rank0

    def version(self) -> str | None:
        return self._state.view().version or self._rank0.version()

    def can_notify(self) -> bool:
        return self._state.view().can_notify

    def observe(self, signal: NoAnswer | int, message: str | None = None, *, closing: bool = False) -> None:
        self._state.observe(signal, message, closing=closing)


@dataclass
class Rank:
    """One rank above 0 (``number``), its proxy, its client to D's rank and D's state there."""

    number: int
    proxy: Proxy
    upstream: Client
    state: DecodeState
    probes: Client  # the state's own connection to D

    async def healthy(self) -> bool:
        """This rank's D answers ``GET /health`` with 200."""
        return (await self.state.fresh()).engine == "alive"

    def drain(self) -> None:
        self.state.draining()

    async def close(self) -> None:
        await self.state.close()
        for client in (self.probes, self.upstream):
            await client.close()


async def start_ranks(config: Config, parts: ProxyParts, connect: Connect) -> list[Rank]:
    """Ranks 1..N-1 sharing ``parts`` but for their own clients to D and their own D state (the
    first probes waited for together)."""
    ranks = []
    for number in range(1, config.data_parallel_size):
        upstream, probes = connect(config, number, None), connect(config, number, 1)
        await upstream.start()
        await probes.start()
        interval, kv = config.decode_health_interval, config.decode_kv_connector
        state = DecodeState(probes, interval=interval, kv_connector=kv)
        decode = RankDecode(state, parts.decode)
        proxy = Proxy(config, dataclasses.replace(parts, upstream=upstream, decode=decode))
        ranks.append(Rank(number, proxy, upstream, state, probes))
    await asyncio.gather(*(r.state.start() for r in ranks))
    return ranks


async def ranks_ready(ranks: list[Rank]) -> dict[str, bool]:
    """``/readyz``'s check of each rank's D."""
    healthy = await asyncio.gather(*(r.healthy() for r in ranks))
    return {f"decode_rank_{r.number}": ok for r, ok in zip(ranks, healthy, strict=True)}
