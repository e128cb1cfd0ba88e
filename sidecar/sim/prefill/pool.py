"""The simulated P's KV block pool and the per-worker bookkeeping that frees it.

``BlockPool`` is shared by the HTTP handlers (``allocate``/``pin``/``release``
on the event loop) and the NIXL worker threads (``on_notification`` and
``reap`` from each worker's poll loop); one lock guards it, held only for
bookkeeping and vLLM's log lines. It mirrors vLLM: each worker keeps its own
insertion-ordered dict of held request ids with their deadlines
(``_reqs_to_send``) and notification counters; a request's blocks return to
the pool only once every worker has finished it, by notification or by
expiry. Block 0 is reserved like vLLM's null block, so ids run 1..num_blocks.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from sidecar.sim.prefill.notifs import (
    Done,
    Heartbeat,
    Malformed,
    expected_notifications,
    heartbeat_extension,
    parse_notification,
)
from sidecar.sim.prefill.release import Release

logger = logging.getLogger("sidecar.sim.prefill")

FreeCause = Literal["notification", "expiry"]
_HISTORY = 4096  # finished requests remembered for /sim/requests/{id}


class PoolFull(Exception):
    """Not enough free blocks for the request (the HTTP layer answers 503)."""


class DuplicateRequest(Exception):
    """A request with this internal id still holds blocks."""


@dataclass
class Counters:
    """The resettable counters of ``/stats``."""

    ranks: int
    freed_by_notification: int = 0
    freed_by_expiry: int = 0
    notifs_unknown: int = 0
    notifs_malformed: int = 0
    notifs_heartbeat: int = 0
    worker_errors: int = 0
    refused_no_blocks: int = 0
    requests_pinned: int = 0
    pinned_block_seconds: float = 0.0
    notifs_per_rank: list[int] = field(default_factory=list)
    rank_finished_by_notification: list[int] = field(default_factory=list)
    rank_finished_by_expiry: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        for name in ("notifs_per_rank", "rank_finished_by_notification", "rank_finished_by_expiry"):
            setattr(self, name, [0] * self.ranks)


@dataclass
class _Held:
    blocks: list[int]
    pinned_at: float
    counts: list[int]
    finished: list[FreeCause | None]


class BlockPool:
    """Blocks, pinned requests and per-rank notification state; thread-safe."""

    def __init__(
        self,
        release: Release,
        *,
        num_blocks: int,
        tp: int,
        pp: int,
        lease: float | None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._release, self.num_blocks, self.tp, self.ranks = release, num_blocks, tp, tp * pp
        self.lease = lease or None  # 0 means "never expires"
        self._clock = clock
        self._lock = threading.Lock()
        self._free: deque[int] = deque(range(1, num_blocks + 1))
        self._held: dict[str, _Held] = {}
        self._pending: list[dict[str, float | None]] = [{} for _ in range(self.ranks)]
        self._history: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self._counters = Counters(self.ranks)
        self._last_change = clock()

    # -- HTTP side -------------------------------------------------------------

    def allocate(self, request_id: str, n_blocks: int) -> list[int]:
        """Take ``n_blocks`` free blocks; raises ``PoolFull`` or ``DuplicateRequest``."""
        with self._lock:
            if request_id in self._held:
                raise DuplicateRequest(request_id)
            if n_blocks > len(self._free):
                self._counters.refused_no_blocks += 1
                raise PoolFull(f"{n_blocks} blocks needed, {len(self._free)} free")
            self._account()
            return [self._free.popleft() for _ in range(n_blocks)]

    def release(self, blocks: list[int]) -> None:
        """Return blocks that were never pinned (request answered and done)."""
        with self._lock:
            self._account()
            self._free.extend(blocks)

    def pin(self, request_id: str, blocks: list[int]) -> None:
        """Hold ``blocks`` until every rank is notified or its lease expires."""
        with self._lock:
            now = self._clock()
            deadline = now + self.lease if self.lease is not None else None
            self._held[request_id] = _Held(blocks, now, [0] * self.ranks, [None] * self.ranks)
            for pending in self._pending:
                pending[request_id] = deadline
            self._counters.requests_pinned += 1

    # -- worker side -----------------------------------------------------------

    def on_notification(self, rank: int, raw: bytes) -> None:
        """Apply one notification received by worker ``rank``."""
        with self._lock:
            self._counters.notifs_per_rank[rank] += 1
            parsed = parse_notification(self._release, raw)
            if isinstance(parsed, Malformed):
                self._malformed(rank, raw, parsed.reason)
            elif isinstance(parsed, Heartbeat):
                self._heartbeat(rank, parsed)
            else:
                self._done(rank, raw, parsed)

    def reap(self, rank: int) -> None:
        """Free what expired on ``rank`` (vLLM's per-step expiry check)."""
        with self._lock:
            now = self._clock()
            expired: list[str] = []
            for request_id, deadline in self._pending[rank].items():
                if deadline is not None and now >= deadline:
                    expired.append(request_id)
                elif not self._release.reap_scans_all:
                    break  # 0.10.0-0.30.x stop at the first live entry
            for request_id in expired:
                logger.warning(
                    "Releasing expired KV blocks for request %s which were retrieved by "
                    "%d decode worker(s) within %d seconds.",
                    request_id,
                    self._held[request_id].counts[rank],
                    self.lease or 0,
                )
                self._finish(rank, request_id, "expiry")

    def _malformed(self, rank: int, raw: bytes, reason: str) -> None:
        self._counters.notifs_malformed += 1
        self._counters.worker_errors += 1
        logger.error("rank %d: notification %r raises in a real P worker: %s", rank, raw, reason)

    def _heartbeat(self, rank: int, beat: Heartbeat) -> None:
        self._counters.notifs_heartbeat += 1
        if self.lease is None:
            return
        extended = self._clock() + heartbeat_extension(self.lease)
        pending = self._pending[rank]
        for request_id in beat.request_ids:
            old = pending.get(request_id)
            if old is not None:  # ids P does not hold are ignored silently
                pending[request_id] = max(old, extended)

    def _done(self, rank: int, raw: bytes, done: Done) -> None:
        held = self._held.get(done.request_id)
        if done.request_id not in self._pending[rank] or held is None:
            self._counters.notifs_unknown += 1
            logger.error(
                "Potentially invalid KV blocks for unrecognized request %s were retrieved "
                "by a decode worker. They may have expired.",
                done.request_id,
            )
            if self._release.unknown_is_fatal:
                self._counters.worker_errors += 1  # 0.9.x/0.10.0: P's engine dies here
            return
        try:
            expected = expected_notifications(self._release, done.count, self.tp)
        except (ValueError, AssertionError, ZeroDivisionError) as exc:
            self._malformed(rank, raw, f"{type(exc).__name__}: {exc}")
            return
        held.counts[rank] += 1
        if held.counts[rank] == expected:
            self._finish(rank, done.request_id, "notification")

    def _finish(self, rank: int, request_id: str, cause: FreeCause) -> None:
        del self._pending[rank][request_id]
        held = self._held[request_id]
        held.finished[rank] = cause
        per_rank = (
            self._counters.rank_finished_by_notification
            if cause == "notification"
            else self._counters.rank_finished_by_expiry
        )
        per_rank[rank] += 1
        if any(state is None for state in held.finished):
            return  # the scheduler frees only when every worker reported it
        self._account()
        del self._held[request_id]
        self._free.extend(held.blocks)
        final: FreeCause = "expiry" if "expiry" in held.finished else "notification"
        if final == "expiry":
            self._counters.freed_by_expiry += 1
        else:
            self._counters.freed_by_notification += 1
        self._remember(request_id, held, final)

    def _remember(self, request_id: str, held: _Held, cause: FreeCause) -> None:
        self._history[request_id] = {
            "request_id": request_id,
            "pinned": False,
            "freed_by": cause,
            "blocks": held.blocks,
            "rank_states": list(held.finished),
            "ranks_notified": [r for r, s in enumerate(held.finished) if s == "notification"],
            "notification_counts": held.counts,
            "expires_in": [None] * self.ranks,
            "held_seconds": self._clock() - held.pinned_at,
            "freed_at": self._clock(),
        }
        while len(self._history) > _HISTORY:
            self._history.popitem(last=False)

    # -- observation -----------------------------------------------------------

    def _account(self) -> None:
        """Advance the blocks-in-use integral up to now (call before a change)."""
        now = self._clock()
        in_use = self.num_blocks - len(self._free)
        self._counters.pinned_block_seconds += in_use * (now - self._last_change)
        self._last_change = now

    def stats(self) -> dict[str, Any]:
        """Counters plus the live block and request figures."""
        with self._lock:
            self._account()
            data = asdict(self._counters)
            del data["ranks"]
            data.update(
                blocks_total=self.num_blocks,
                blocks_in_use=self.num_blocks - len(self._free),
                pinned_requests=len(self._held),
                lease=self.lease,
            )
            return data

    def reset_counters(self) -> None:
        """Zero every counter (pinned requests and blocks stay as they are)."""
        with self._lock:
            self._counters = Counters(self.ranks)
            self._last_change = self._clock()

    def describe(self, request_id: str) -> dict[str, Any] | None:
        """What P knows about one internal request id, or None if never pinned."""
        with self._lock:
            held = self._held.get(request_id)
            if held is None:
                past = self._history.get(request_id)
                return dict(past) if past is not None else None
            now = self._clock()
            deadlines = [pending.get(request_id) for pending in self._pending]
            return {
                "request_id": request_id,
                "pinned": True,
                "freed_by": None,
                "blocks": list(held.blocks),
                "rank_states": list(held.finished),
                "ranks_notified": [r for r, s in enumerate(held.finished) if s == "notification"],
                "notification_counts": list(held.counts),
                "expires_in": [None if d is None else d - now for d in deadlines],
                "held_seconds": now - held.pinned_at,
            }
