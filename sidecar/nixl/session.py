"""The sidecar's NIXL session with P's workers: handshakes shared, cached, dropped and swept.

``Session.peers`` gives the P workers' agents for one job: from the cache
(``HandshakeCache``) when it serves the job's engine, generation, endpoint and
ranks, else from a handshake. Concurrent jobs for one engine share one
handshake; a job cancelled mid-handshake gives the jobs waiting on it a
timeout they retry, not its cancellation. A handshake first drops the
engine's old agents (NIXL names an agent by the remote, so removing an old
entry after re-adding the same worker would remove the new one), checks the
target against the allowlist (``TargetCheck``; a loopback ``remote_host`` is
warned about unless the allowlist names that loopback endpoint), asks rank
(0, 0) first and stops there when it serves another engine, and records the P
process it reached (``sidecar.nixl.lineage``), with its topology when the
parameters are P's own (``claim`` refuses, before any contact, parameters no
one vouched for that claim more ranks than that). Entries leave the cache by
LRU, by TTL (``sweep``), on a failed send (``invalidate``) and at shutdown;
each leaving agent is removed from the NIXL peer.
"""

from __future__ import annotations

import asyncio
import logging
import time

import zmq.asyncio

from sidecar.config import Config
from sidecar.exceptions import ReleaseError, TargetHealth
from sidecar.nixl import HandshakeTimeout, TopologyMismatch
from sidecar.nixl.handshake import HandshakeCache, HandshakeClient, PeerSet, Rank, Target, TargetCheck
from sidecar.nixl.lineage import Lineage
from sidecar.nixl.metrics import NixlMetrics
from sidecar.nixl.peer import NixlPeer
from sidecar.nixl.versions import WireProfile
from sidecar.observability.tracing import OFF, Tracing

log = logging.getLogger("sidecar.release.nixl")

LOOPBACK_LOG_INTERVAL = 60.0
Endpoint = tuple[str, int]


class Session:
    """P's workers as the ``nixl`` strategy reaches them (see the module docstring)."""

    def __init__(
        self, config: Config, metrics: NixlMetrics, peer: NixlPeer, check: TargetCheck, tracing: Tracing = OFF
    ) -> None:
        self._config = config
        self.metrics = metrics
        self.peer = peer
        self.check = check
        self._tracing = tracing
        self._context: zmq.asyncio.Context | None = None
        self._client: HandshakeClient | None = None
        self.cache = HandshakeCache(config.handshake_cache_size, config.handshake_cache_ttl)
        self.lineage = Lineage(config.handshake_cache_size, config.handshake_cache_ttl)
        self.pending: dict[str, asyncio.Future[PeerSet]] = {}  # handshakes in flight, by engine
        self._last_sweep = time.monotonic()
        self._loopback_at = -LOOPBACK_LOG_INTERVAL
        self._loopback_warned: set[str] = set()

    async def start(self) -> None:
        self._context = zmq.asyncio.Context()
        self._client = HandshakeClient(self._context, self._config.handshake_timeout)
        self.peer.on_replaced.append(self._forget)
        await self.peer.start()

    async def close(self) -> None:
        await self.drop(self.cache.drain(), "shutdown")
        await self.peer.close()
        if self._context is not None:
            self._context.destroy(linger=0)
            self._context = None

    def _forget(self) -> None:
        """The peer's agent was replaced: the P agents the old one loaded are not in the new one,
        so every engine is handshaken again (nothing to remove: the old agent is abandoned)."""
        self.cache.drain()
        self.metrics.engines.set(0)

    def ready(self) -> bool:
        return self._context is not None and self.peer.ready()

    def claim(self, engine_id: str, endpoint: Endpoint, ranks: list[Rank], vouched: bool) -> None:
        """Raise ``TopologyMismatch`` when parameters no one vouched for claim a rank that P's own
        parameters did not name for the process at ``endpoint`` (``Lineage.topology``): asking P
        for a rank it lacks would end its listener. Without such evidence the claim stands
        (docs/security.md says what that leaves open)."""
        known = None if vouched else self.lineage.topology(endpoint, engine_id)
        if known is None:
            return
        extra = sorted(set(ranks) - known)
        if extra:
            raise TopologyMismatch(
                f"the parameters claim rank {extra[0]} of engine {engine_id!r} at "
                f"{endpoint[0]}:{endpoint[1]}, which P's own parameters did not name "
                f"({len(known)} rank(s)): nothing is asked of P"
            )

    async def peers(
        self,
        engine_id: str,
        generation: int | None,
        endpoint: Endpoint,
        profile: WireProfile,
        ranks: list[Rank],
        vouched: bool = False,
    ) -> tuple[PeerSet, str]:
        """The agents of ``ranks`` and how they were found (``warm``: cached; ``cold``).
        ``vouched``: the parameters are P's own, so ``ranks`` are every rank of P's engine."""
        peers = self.cache.get(engine_id)
        if peers is not None and peers.serves(generation, endpoint, ranks):
            self.metrics.lookup("hit").inc()
            if vouched:
                self.lineage.vouched(endpoint, [peers.agents[rank] for rank in ranks], engine_id, ranks)
            return peers, "warm"
        self.metrics.lookup("miss").inc()
        return await self.connect(engine_id, generation, endpoint, profile, ranks, vouched), "cold"

    async def connect(
        self,
        engine_id: str,
        generation: int | None,
        endpoint: Endpoint,
        profile: WireProfile,
        ranks: list[Rank],
        vouched: bool = False,
    ) -> PeerSet:
        """A handshake, or the one in flight for ``engine_id`` when it serves these ranks."""
        pending = self.pending.get(engine_id)
        if pending is not None:
            peers = await asyncio.shield(pending)
            if peers.serves(generation, endpoint, ranks):
                return peers
        future: asyncio.Future[PeerSet] = asyncio.get_running_loop().create_future()
        self.pending[engine_id] = future
        try:
            # The span is made on the event loop around the await; the NIXL thread never sees it.
            with self._tracing.handshake_span(engine_id, endpoint, ranks):
                peers = await self._handshake(engine_id, generation, endpoint, profile, ranks, vouched)
        except asyncio.CancelledError:
            # The job that began it was cancelled (its deadline): the jobs waiting on this
            # handshake get a timeout they retry, not a cancellation that is not theirs.
            future.set_exception(HandshakeTimeout("the handshake was abandoned by the job that began it"))
            future.exception()
            raise
        except BaseException as exc:
            future.set_exception(exc)
            future.exception()  # retrieved here; waiters re-raise it
            raise
        else:
            future.set_result(peers)
            return peers
        finally:
            if self.pending.get(engine_id) is future:
                del self.pending[engine_id]

    async def _handshake(
        self,
        engine_id: str,
        generation: int | None,
        endpoint: Endpoint,
        profile: WireProfile,
        ranks: list[Rank],
        vouched: bool,
    ) -> PeerSet:
        assert self._client is not None, "start() first"
        # The old set's agents go first: NIXL names an agent by the remote, so a re-add of
        # the same P worker followed by removing the old entry would remove the new one.
        for old in self.cache.take(engine_id):
            if old.engine_id != engine_id:
                await self.drop([old], "ttl")
            else:
                await self.drop([old], "generation" if old.generation != generation else "replaced")
        host, base_port = endpoint
        target = await self.target(host, sorted({profile.port(base_port, tp) for _, tp in ranks}))
        started = time.perf_counter()
        try:
            try:
                replies = await self._client.fetch(target, profile, ranks, engine_id)
            except ReleaseError as exc:
                if exc.health is TargetHealth.DOWN:
                    self.lineage.lost(endpoint)
                raise
            agents: dict[Rank, str] = {}
            try:
                for rank in ranks:
                    agents[rank] = await self.peer.add_remote(replies[rank].agent_metadata)
            except ReleaseError:
                await self.peer.remove_remote(list(agents.values()))
                raise
        except ReleaseError:
            self.metrics.handshakes.labels("error").inc()
            raise
        self.metrics.handshakes.labels("ok").inc()
        self.metrics.handshake_seconds.observe(time.perf_counter() - started)
        peers = PeerSet(engine_id, generation, endpoint, agents)
        self.lineage.seen(endpoint, agents.values())
        if vouched:
            self.lineage.vouched(endpoint, agents.values(), engine_id, ranks)
        await self.drop(self.cache.put(peers), "lru")
        return peers

    async def target(self, host: str, ports: list[int]) -> Target:
        """P's side-channel ``ports`` on ``host``, checked against the allowlist (raises
        ``PermanentReleaseError`` outside it); a loopback host is warned about."""
        target = await self.check.target(host, ports)
        self._warn_loopback(target)
        return target

    async def invalidate(self, peers: PeerSet, reason: str) -> None:
        """A send through ``peers`` failed: they leave the cache (P may have restarted)."""
        if self.cache.pop(peers.engine_id, peers) is not None:
            await self.drop([peers], reason)

    async def drop(self, entries: list[PeerSet], reason: str) -> None:
        """Remove the agents of ``entries`` (out of the cache already) from the NIXL peer."""
        self.metrics.engines.set(len(self.cache))
        if not entries:
            return
        self.metrics.evictions.labels(reason).inc(len(entries))
        if self.peer.ready():
            await self.peer.remove_remote([name for entry in entries for name in entry.agents.values()])

    async def sweep(self) -> bool:
        """Drop expired entries, at most once per ``min(ttl, 60 s)``; True when it swept."""
        now = time.monotonic()
        if now - self._last_sweep < min(self._config.handshake_cache_ttl, 60.0):
            return False
        self._last_sweep = now
        await self.drop(self.cache.expire(), "ttl")
        return True

    def _warn_loopback(self, target: Target) -> None:
        """A loopback target is counted and warned about, unless the allowlist names it itself (P on
        this machine, a local trial): then P announced where it runs, not vLLM's default."""
        if not target.loopback or self.check.allowlist.names_loopback(
            target.host, target.address, target.base_port
        ):
            return
        self.metrics.loopback.inc()
        now = time.monotonic()
        if target.host in self._loopback_warned or now - self._loopback_at < LOOPBACK_LOG_INTERVAL:
            return
        if len(self._loopback_warned) < 1024:
            self._loopback_warned.add(target.host)
        self._loopback_at = now
        log.warning(
            "P's remote_host %r is a loopback address: P may have left VLLM_NIXL_SIDE_CHANNEL_HOST "
            "at its default (localhost); the sidecar contacts its own host",
            target.host,
        )
