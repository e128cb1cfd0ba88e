"""Which P process a release is for, when P's side channel comes back as a new process.

A P that restarts at the same address, even with the same engine id (an
operator's ``--engine-id``), is a new process: the requests the old one held
are gone with it, and a notification naming one of them reaches the new P as
an unknown id (logged as an error; fatal to P's engine before vLLM 0.10.1).
What tells the two apart is the NIXL agent names the handshake returns: vLLM
names each worker's agent with a random UUID when the process starts
(``NixlConnectorWorker``), so the set of names is the process's identity. Every
handshake asks rank (0, 0), so two handshakes with one process share a name,
and a process that came after shares none: a handshake whose names meet the
identity adds to it, one whose names do not is a new process.

``Lineage`` remembers, per P endpoint, the identity last handshaken, when it
was first seen, and the outage that came before it when it replaced an
identity seen earlier (the first failed contact after the last success). A
release for a request the sidecar saw rejected at
``created`` goes to identity X unless X was first seen after ``created`` and
an outage came between: then the request was rejected within
``RESTART_GRACE`` of P being found unreachable (it was prefilled by the P
that went away, a decode leg trailing its prefill by well under a second),
and the release is refused (``p_restarted``). A request rejected later than
that was prefilled by the P that came back, and is released at once.

``Lineage`` also keeps the evidence of P's topology that a client cannot
forge: the ranks P's own parameters named (P's answer to a router's prefill
leg, or parameters the router hop vouched for) for the process at that
address and the engine it serves. ``topology`` gives it; a new process has
none until such parameters are handshaken again.

What this cannot see: a P that restarted while the sidecar sent it nothing
(no outage observed), or before the sidecar ever reached it, is taken as the
same lineage, so a release pending across that restart reaches the new P as
an unknown id (an error line in P's log; harmless from vLLM 0.10.1, and the
sidecar refuses 0.9.x and 0.10.0 unless told otherwise); and a P that
restarts within ``RESTART_GRACE`` of being found gone has its first releases
refused (P's lease frees those blocks).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection
from dataclasses import dataclass

from sidecar.ttlmap import TTLMap

#: How long after P is found unreachable a rejected request is still taken as the old P's.
RESTART_GRACE = 1.0
Endpoint = tuple[str, int]  # P's host as the parameters name it, and its side-channel base port
Identity = frozenset[str]  # the NIXL agent names of P's workers
Rank = tuple[int, int]  # (pp_rank, tp_rank)


@dataclass(slots=True)
class _Record:
    identity: Identity | None = None
    since: float = 0.0  # when ``identity`` was first seen
    lost_at: float | None = None  # first failed contact since the last success
    lost_before: float | None = None  # the outage observed before ``identity`` appeared
    engine_id: str = ""  # the engine ``topology`` is of
    topology: frozenset[Rank] | None = None  # every rank of ``identity``, as P's own parameters named them


class Lineage:
    """P's processes per endpoint, as the sidecar's handshakes saw them (module docstring)."""

    def __init__(self, size: int, ttl: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._records: TTLMap[Endpoint, _Record] = TTLMap(size, ttl, clock)

    def _record(self, endpoint: Endpoint) -> _Record:
        record = self._records.get(endpoint)
        if record is None:
            record = self._records[endpoint] = _Record()
        return record

    def lost(self, endpoint: Endpoint) -> None:
        """A contact with ``endpoint`` failed (refused, no reply in time)."""
        record = self._record(endpoint)
        if record.lost_at is None:
            record.lost_at = self._clock()

    def seen(self, endpoint: Endpoint, agents: Collection[str]) -> None:
        """A handshake with ``endpoint`` returned these agent names."""
        record, names = self._record(endpoint), frozenset(agents)
        if record.identity is not None and record.identity & names:
            record.identity |= names  # the same process: more of its ranks
        else:
            # Only a process seen before can have been replaced: at first contact after an outage,
            # P may as well be the same process that was merely unreachable.
            record.lost_before = record.lost_at if record.identity is not None else None
            record.identity, record.since = names, self._clock()
            record.topology = None  # a new process: its topology is unknown (and ``engine_id`` moot)
        record.lost_at = None

    def vouched(
        self, endpoint: Endpoint, agents: Collection[str], engine_id: str, ranks: Collection[Rank]
    ) -> None:
        """P's own parameters named ``ranks`` as every rank of ``engine_id``, and ``agents`` (of
        the process last seen at ``endpoint``) serve them: that is its topology."""
        record = self._records.get(endpoint)
        if record is not None and record.identity is not None and frozenset(agents) <= record.identity:
            record.engine_id, record.topology = engine_id, frozenset(ranks)

    def topology(self, endpoint: Endpoint, engine_id: str) -> frozenset[Rank] | None:
        """Every rank of ``engine_id`` at ``endpoint`` as P's own parameters named them, for the
        process last handshaken there; None when no such parameters were."""
        record = self._records.get(endpoint)
        if record is None or record.topology is None or record.engine_id != engine_id:
            return None
        return record.topology

    def refusal(self, endpoint: Endpoint, agents: Collection[str], created: float) -> str | None:
        """Why a release of a request rejected at ``created`` must not go to these agents, or None."""
        record = self._records.get(endpoint)
        if record is None or record.identity is None or created >= record.since:
            return None
        if not frozenset(agents) <= record.identity:
            return None
        if record.lost_before is None or created >= record.lost_before + RESTART_GRACE:
            return None
        gap = record.lost_before - created
        when = f"{abs(gap):.3f} s {'before' if gap >= 0 else 'after'}"
        return (
            f"the request was rejected {when} P at {endpoint[0]}:{endpoint[1]} was found unreachable, "
            "and P came back as a new process (new NIXL agents): its blocks went with the old one"
        )
