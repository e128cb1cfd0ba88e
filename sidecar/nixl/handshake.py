"""Handshakes with P's side channel: the target check, the async ZMQ REQ client, the cache.

``resolve_target`` checks P's endpoint against the allowlist before any
socket exists (a host name is resolved asynchronously, every address is
checked, and the checked address is what gets connected). ``HandshakeClient``
asks each P worker for its metadata with a REQ socket in the framing of P's
release (``messages``), with a deadline on every receive; a socket is used
for one handshake and closed with linger 0 (a REQ that timed out is never
reused). Rank (0, 0) is asked first, alone, and the other ranks only when its
reply names the engine the parameters name: a forged or stale engine id never
gets a request for a rank P may lack, which would end P's listener thread.
A socket monitor turns a refused or dropped connection into
``PeerUnreachable`` at once instead of waiting for the timeout.
``HandshakeCache`` remembers, per P engine, the NIXL agent names of its
workers so later releases to the same P cost no handshake.
"""

from __future__ import annotations

import asyncio
import ipaddress
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from sidecar.exceptions import PermanentReleaseError, Reason, TargetHealth
from sidecar.network.allowlist import Allowlist, ip_or_none, is_host_name
from sidecar.network.resolver import Resolver
from sidecar.nixl import EngineMismatch, HandshakeTimeout, PeerUnreachable, TopologyMismatch
from sidecar.nixl.messages import PeerMetadata, decode_reply, encode_request
from sidecar.nixl.versions import WireProfile
from sidecar.ttlmap import TTLMap

_T = TypeVar("_T")

Rank = tuple[int, int]  # (pp_rank, tp_rank)

_FAILED = (
    zmq.EVENT_CONNECT_RETRIED,  # refused: nothing listens there
    zmq.EVENT_DISCONNECTED,  # P went away mid-handshake; a REQ would wait forever
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL,
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
    zmq.EVENT_HANDSHAKE_FAILED_AUTH,
)
_WATCHED = sum(_FAILED) | zmq.EVENT_MONITOR_STOPPED


@dataclass(frozen=True, slots=True)
class Target:
    """A checked P endpoint: connect to ``address`` (an IP), never to the name again."""

    host: str  # as in kv_transfer_params (for logs)
    address: str
    base_port: int

    @property
    def loopback(self) -> bool:
        return ipaddress.ip_address(self.address).is_loopback


async def resolve_target(allowlist: Allowlist, resolver: Resolver, host: str, ports: Sequence[int]) -> Target:
    """Check ``host`` on every port in ``ports`` and pick the address to connect to.

    Permanent refusals, made before any connection and never retried: a host that is
    neither an IP literal nor a DNS name (``bad_host``), a port outside 1-65535
    (``bad_port``), a target outside the allowlist (``not_allowed``; a name no allowlist
    entry could admit is refused without a lookup) and a name that does not exist
    (``unresolvable``). A resolver that gives no answer now raises ``ResolveFailed``.
    """
    literal = ip_or_none(host)
    if literal is None and not is_host_name(host):
        raise PermanentReleaseError(
            f"P host {host!r} is neither an IP address nor a DNS name", Reason.BAD_HOST
        )
    bad = [port for port in ports if not 0 < port <= 65535]
    if bad:
        raise PermanentReleaseError(f"P side-channel port {bad[0]} is outside 1-65535", Reason.BAD_PORT)
    if literal is not None:
        addresses = [str(literal)]
    elif all(allowlist.allows_name(host, port) or allowlist.may_admit_address(port) for port in ports):
        addresses = await resolver.resolve(host, ports[0])
    else:
        addresses = []  # no entry can admit this name on these ports: no lookup needed
    for port in ports:
        if not addresses or not allowlist.allows(host, port, addresses if literal is None else None):
            shown = f" ({', '.join(addresses)})" if addresses and literal is None else ""
            raise PermanentReleaseError(
                f"P endpoint {host}:{port}{shown} is not in --prefill-allow", reason=Reason.NOT_ALLOWED
            )
    return Target(host=host, address=addresses[0], base_port=ports[0])


class TargetCheck:
    """The allowlist and the resolver a release's P endpoint is checked with (``resolve_target``)."""

    def __init__(self, allowlist: Allowlist, resolver: Resolver | None = None) -> None:
        self.allowlist = allowlist
        self.resolver = resolver or Resolver()

    async def target(self, host: str, ports: Sequence[int]) -> Target:
        return await resolve_target(self.allowlist, self.resolver, host, ports)


def zmq_endpoint(address: str, port: int) -> str:
    return f"tcp://[{address}]:{port}" if ":" in address else f"tcp://{address}:{port}"


class HandshakeClient:
    """Fetches P workers' metadata; one context (owned by the strategy), one REQ per handshake."""

    def __init__(self, context: zmq.asyncio.Context, timeout: float) -> None:
        self._context = context
        self._timeout = timeout

    async def fetch(
        self, target: Target, profile: WireProfile, ranks: Sequence[Rank], engine_id: str
    ) -> dict[Rank, PeerMetadata]:
        """Every rank's metadata, within one ``timeout`` for the whole engine.

        Rank (0, 0) is asked first, alone, and the other ranks only once its reply names
        ``engine_id``: a forged or stale engine id stops there (``EngineMismatch``), before any
        request for a rank that P may lack (which ends vLLM's listener thread from 0.11.1, 1.6).
        Every other reply is checked too: before 0.11.1 each worker listens on its own port,
        where another engine's worker may answer (``TopologyMismatch``).
        """
        deadline = asyncio.get_running_loop().time() + self._timeout
        first = (0, 0)
        assert first in ranks, "every P has rank (0, 0)"
        rest = [rank for rank in ranks if rank != first]
        if profile.wire.listener == "scheduler":
            port = profile.port(target.base_port, 0)
            return await self._session(target.address, port, profile, [first, *rest], deadline, engine_id)
        # 0.9.x-0.11.0: one listener per TP worker; rank 0 first, then the others in parallel.
        replies = await self._session(
            target.address, profile.port(target.base_port, 0), profile, [first], deadline, engine_id
        )
        parts = await _all(
            [
                self._session(
                    target.address,
                    profile.port(target.base_port, tp),
                    profile,
                    [(pp, tp)],
                    deadline,
                    engine_id,
                )
                for pp, tp in rest
            ]
        )
        for part in parts:
            replies.update(part)
        return replies

    async def _session(
        self,
        address: str,
        port: int,
        profile: WireProfile,
        ranks: Sequence[Rank],
        deadline: float,
        engine_id: str,
    ) -> dict[Rank, PeerMetadata]:
        sock = self._context.socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        if ":" in address:
            sock.setsockopt(zmq.IPV6, 1)
        monitor = sock.get_monitor_socket(_WATCHED)
        watcher = asyncio.ensure_future(_watch(monitor))
        endpoint = zmq_endpoint(address, port)
        try:
            sock.connect(endpoint)
            replies: dict[Rank, PeerMetadata] = {}
            for pp_rank, tp_rank in ranks:
                # The send is bounded too: a REQ whose connection P's end refused or garbled
                # may have no pipe to queue on, and would wait for a reconnect forever.
                await _bounded(
                    sock.send(encode_request(profile, pp_rank, tp_rank)), watcher, deadline, endpoint
                )
                frames = await _bounded(sock.recv_multipart(), watcher, deadline, endpoint)
                meta = decode_reply(profile, frames)
                _check_engine(meta, (pp_rank, tp_rank), engine_id, endpoint)
                replies[(pp_rank, tp_rank)] = meta
            return replies
        finally:
            watcher.cancel()
            sock.disable_monitor()
            monitor.close(linger=0)
            sock.close(linger=0)


def _check_engine(meta: PeerMetadata, rank: Rank, engine_id: str, endpoint: str) -> None:
    """Raise unless ``meta`` (rank ``rank``'s reply from ``endpoint``) names ``engine_id``."""
    if meta.engine_id == engine_id:
        return
    if rank == (0, 0):
        raise EngineMismatch(f"{endpoint} serves engine {meta.engine_id!r}, not {engine_id!r}")
    raise TopologyMismatch(
        f"rank {rank} at {endpoint} answers for engine {meta.engine_id!r}, not {engine_id!r}: "
        "P does not have the ranks the parameters claim",
        TargetHealth.UP,
    )


async def _all(operations: list[Awaitable[_T]]) -> list[_T]:
    """Every result; on the first failure the others are cancelled (and awaited) first."""
    tasks = [asyncio.ensure_future(op) for op in operations]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _watch(monitor: zmq.asyncio.Socket) -> int:
    """Return the first event that means the connection failed (or the monitor stopped)."""
    while True:
        event = parse_monitor_message(await monitor.recv_multipart())["event"]
        if event in _FAILED or event == zmq.EVENT_MONITOR_STOPPED:
            return int(event)


async def _bounded(
    operation: Awaitable[_T], watcher: asyncio.Future[int], deadline: float, endpoint: str
) -> _T:
    """``operation``'s result, unless the deadline passes or the monitor saw the connection fail."""
    loop = asyncio.get_running_loop()
    pending: asyncio.Future[_T] = asyncio.ensure_future(operation)
    try:
        waiting: set[asyncio.Future[object]] = {pending, watcher}  # type: ignore[arg-type]
        while True:
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise HandshakeTimeout(f"no handshake reply from {endpoint} in time")
            done, _ = await asyncio.wait(waiting, timeout=remaining, return_when=asyncio.FIRST_COMPLETED)
            if pending in done:
                return pending.result()
            if watcher in done:
                if watcher.result() != zmq.EVENT_MONITOR_STOPPED:
                    raise PeerUnreachable(f"P side channel {endpoint} refused or dropped the connection")
                waiting = {pending}  # type: ignore[arg-type]
    finally:
        if not pending.done():
            pending.cancel()


@dataclass(slots=True)
class PeerSet:
    """One P engine's workers as known to the sidecar's NIXL agent."""

    engine_id: str
    generation: int | None  # remote_registration_generation (0.33.0+)
    endpoint: tuple[str, int]  # (address, base_port)
    agents: dict[Rank, str]

    def serves(self, generation: int | None, endpoint: tuple[str, int], ranks: Sequence[Rank]) -> bool:
        """Whether this set can release a request with these parameters."""
        if self.endpoint != endpoint or any(rank not in self.agents for rank in ranks):
            return False
        if generation is None:
            return True
        # An older generation's request is still P's to free; a newer one means re-registration.
        return self.generation is not None and generation <= self.generation


class HandshakeCache:
    """P's engines the sidecar's agent knows, by engine id: bounded (least recently used go
    first) and forgetting a set ``ttl`` seconds after its handshake. Every set that leaves is
    returned to the caller, which removes its agents (``remove_remote_agent``)."""

    def __init__(self, size: int, ttl: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._sets: TTLMap[str, PeerSet] = TTLMap(size, ttl, clock, keep_dropped=True)

    def __len__(self) -> int:
        return len(self._sets)

    def get(self, engine_id: str) -> PeerSet | None:
        """The live set for ``engine_id`` (refreshing its LRU position), or None.

        An expired set stays in the map until ``take``/``put``/``expire`` hands it back: the
        caller must remove its agents before it adds the same P workers again (NIXL names an
        agent by the remote's name, so a later removal would undo the new add).
        """
        return self._sets.get(engine_id)

    def take(self, engine_id: str) -> list[PeerSet]:
        """Remove the set of ``engine_id``, live or expired, and every other expired set."""
        self._sets.expire()
        live = self._sets.pop(engine_id, None)
        return [entry for _, entry in self._sets.take_dropped()] + ([live] if live is not None else [])

    def put(self, entry: PeerSet) -> list[PeerSet]:
        """Insert ``entry``; returns what it displaced (expired, same engine, LRU overflow)."""
        old = self._sets.pop(entry.engine_id, None)
        self._sets[entry.engine_id] = entry
        dropped = [e for _, e in self._sets.take_dropped()]
        return dropped + ([old] if old is not None and old is not entry else [])

    def pop(self, engine_id: str, entry: PeerSet) -> PeerSet | None:
        """Remove the set of ``engine_id`` if it is still ``entry`` and live."""
        if self._sets.get(engine_id) is not entry:
            return None
        return self._sets.pop(engine_id)

    def expire(self) -> list[PeerSet]:
        """Remove and return every set older than the TTL."""
        self._sets.expire()
        return [entry for _, entry in self._sets.take_dropped()]

    def drain(self) -> list[PeerSet]:
        """Remove and return everything (shutdown)."""
        self._sets.expire(float("inf"))
        return [entry for _, entry in self._sets.take_dropped()]
