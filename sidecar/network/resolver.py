"""Name resolution for P endpoints: the system resolver, one bounded cache shared by every job.

A P host name is resolved with ``getaddrinfo`` (so ``/etc/hosts``, search
domains and the pod's resolver apply, as for any client in the pod). The
system resolver does not report record TTLs, so answers are kept for fixed
times chosen to match Kubernetes' CoreDNS (``cache 30``): an address list for
``ttl`` (30 s), a name that does not exist for ``negative_ttl`` (5 s), and a
temporary failure (no answer from the DNS server) for one second, so a storm
of releases to one name costs one lookup per interval, not one per attempt.
Concurrent lookups of one name share a single ``getaddrinfo`` call.

A name that does not exist (NXDOMAIN, no address) is ``Unresolvable``, a
permanent refusal; a temporary failure is ``ResolveFailed``, which the
pipeline retries and counts against the target's breaker.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Awaitable, Callable

from cachetools import TLRUCache

from sidecar.exceptions import PermanentReleaseError, Reason, RetryableReleaseError, TargetHealth

Lookup = Callable[[str, int], Awaitable[list[str]]]

#: getaddrinfo errors that mean "this name has no address", as opposed to "no answer now".
_NO_SUCH_NAME = frozenset(
    code
    for code in (
        getattr(socket, "EAI_NONAME", None),
        getattr(socket, "EAI_NODATA", None),
        getattr(socket, "EAI_ADDRFAMILY", None),
    )
    if code is not None
)


class Unresolvable(PermanentReleaseError):
    """The name does not exist, or has no address: retrying cannot help."""

    def __init__(self, message: str) -> None:
        super().__init__(message, Reason.UNRESOLVABLE)


class ResolveFailed(RetryableReleaseError):
    """The resolver gave no answer now (a DNS server down or slow): worth retrying."""

    reason = Reason.DNS_FAILURE
    health = TargetHealth.DOWN


async def system_lookup(host: str, port: int) -> list[str]:
    """Every address ``getaddrinfo`` gives for ``host`` (TCP), in its order, without repeats."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


class Resolver:
    """Cached, shared name resolution (see the module docstring)."""

    def __init__(
        self,
        size: int = 4096,
        ttl: float = 30.0,
        negative_ttl: float = 5.0,
        failure_ttl: float = 1.0,
        lookup: Lookup = system_lookup,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._lookup = lookup
        self._ttls = {"ok": ttl, "missing": negative_ttl, "failed": failure_ttl}
        self._cache: TLRUCache[str, tuple[str, list[str] | str]] = TLRUCache(
            maxsize=size, ttu=self._ttu, timer=clock
        )
        self._pending: dict[str, asyncio.Future[tuple[str, list[str] | str]]] = {}

    def _ttu(self, _key: str, value: tuple[str, list[str] | str], now: float) -> float:
        return now + self._ttls[value[0]]

    async def resolve(self, host: str, port: int) -> list[str]:
        """The addresses of ``host``; raises ``Unresolvable`` or ``ResolveFailed``."""
        entry = self._cache.get(host)
        if entry is None:
            pending = self._pending.get(host)
            if pending is None:
                pending = asyncio.ensure_future(self._fetch(host, port))
                self._pending[host] = pending
                pending.add_done_callback(lambda _: self._pending.pop(host, None))
            entry = await asyncio.shield(pending)
        kind, answer = entry
        if kind == "ok":
            assert isinstance(answer, list)
            return answer
        if kind == "missing":
            raise Unresolvable(f"P host {host!r} does not resolve: {answer}")
        raise ResolveFailed(f"cannot resolve P host {host!r} now: {answer}")

    async def _fetch(self, host: str, port: int) -> tuple[str, list[str] | str]:
        entry: tuple[str, list[str] | str]
        try:
            addresses = await self._lookup(host, port)
        except socket.gaierror as exc:
            entry = ("missing" if exc.errno in _NO_SUCH_NAME else "failed", str(exc))
        except OSError as exc:
            entry = ("failed", str(exc))
        else:
            entry = ("ok", addresses) if addresses else ("missing", "no address")
        self._cache[host] = entry
        return entry
