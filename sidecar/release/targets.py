"""Per-target health for the release pipeline: a concurrency cap and a circuit breaker each.

A target is where a release attempt connects: one P side channel
(``host:port``) for the NIXL strategy, D's control endpoint for the HTTP one.
A dead P must not slow the releases of a live one, so every target has:

* a cap on attempts in flight (a share of the pipeline's workers), so one
  target never holds them all;
* a breaker. ``closed``: attempts run. After ``failures`` consecutive connect
  failures (refused, unreachable, no handshake reply) it is ``open``: no
  attempt is made, and its jobs wait without a worker until their deadline.
  After an interval it is ``half_open``: one waiting job's own attempt is the
  probe (no extra request is ever sent to P). A job made after the last
  failure probes ``FRESH_GAP`` after it at the latest, whatever the interval:
  its request was prefilled by that P since, so P is likely back (a dead P
  then costs at most one attempt per ``FRESH_GAP`` while new rejections keep
  naming it). A probe that connects (any job's) closes the breaker and the
  jobs waiting for it go at once; one that fails opens it again for twice
  the interval (up to ``max_interval``).

Waiters are woken in FIFO order, one per freed slot, so a storm to one target
costs O(1) per attempt. State changes are logged at most ``LOG_BURST`` lines
per ``LOG_WINDOW`` seconds (the rest are counted in the next line), and
``kvr_release_targets{state}`` counts targets per state, never per host.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum

from prometheus_client import Gauge

from sidecar.release.base import TargetHealth

log = logging.getLogger("sidecar.release")

LOG_WINDOW = 10.0
LOG_BURST = 5
FRESH_GAP = 0.5  # seconds after a failure before a job made since may probe


class BreakerState(StrEnum):
    """Where one target's circuit breaker is: closed (attempts run), open (held), half open (one probe)."""

    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


@dataclass(frozen=True, slots=True)
class BreakerPolicy:
    failures: int = 3  # consecutive connect failures that open a closed target
    interval: float = 0.5  # first open interval; doubles per failed probe
    max_interval: float = 8.0


@dataclass(slots=True)
class Grant:
    """Permission for one attempt; handed back with ``Target.done``."""

    probe: bool


class TargetDown(Exception):
    """The job's deadline passed while its target's breaker was open."""


class Target:
    """One target's breaker and cap (see the module docstring)."""

    def __init__(self, key: str, cap: int, policy: BreakerPolicy, owner: Targets) -> None:
        self.key = key
        self.state = BreakerState.CLOSED
        self._cap = cap
        self._policy = policy
        self._owner = owner
        self._failures = 0
        self._interval = policy.interval
        self._retry_at = 0.0
        self._failed_at = float("-inf")  # the last connect failure
        self._probing = False
        self._timer: asyncio.TimerHandle | None = None
        self.running = 0
        self.waiting: collections.deque[asyncio.Future[None]] = collections.deque()
        self.jobs = 0  # live jobs naming this target (kept while > 0)

    @property
    def idle(self) -> bool:
        return self.jobs == 0 and self.running == 0 and not self.waiting

    def _try(self, created: float) -> Grant | None:
        if self.state is BreakerState.OPEN and created > self._failed_at:
            self._soon(self._failed_at + FRESH_GAP)  # a request P prefilled since it failed
        if self.state is BreakerState.OPEN and self._owner.clock() >= self._retry_at:
            self._set(BreakerState.HALF_OPEN)
        if self.state is BreakerState.CLOSED and self.running < self._cap:
            self.running += 1
            return Grant(probe=False)
        if self.state is BreakerState.HALF_OPEN and not self._probing:
            self._probing = True
            self.running += 1
            return Grant(probe=True)
        return None

    async def acquire(
        self, deadline: float, on_blocked: Callable[[], None], created: float = float("-inf")
    ) -> Grant:
        """Wait (holding no worker) until an attempt may run; ``TargetDown`` or ``TimeoutError``
        at ``deadline``. ``on_blocked`` is called once when the job first finds the breaker open;
        ``created``: when the job was made (one made after the last failure may probe at once)."""
        blocked = woken = False
        while True:
            grant = self._try(created)
            if grant is not None:
                return grant
            if self.state is not BreakerState.CLOSED and not blocked:
                blocked = True
                on_blocked()
            waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            # Woken but beaten to the slot: keep the place at the head of the line.
            (self.waiting.appendleft if woken else self.waiting.append)(waiter)
            try:
                async with asyncio.timeout(max(0.0, deadline - self._owner.clock())):
                    await waiter
            except BaseException as exc:
                if waiter.done() and not waiter.cancelled():
                    self.wake(1)  # woken, but leaving: hand the wake-up on
                else:
                    waiter.cancel()
                    with contextlib.suppress(ValueError):
                        self.waiting.remove(waiter)
                if isinstance(exc, TimeoutError) and self.state is not BreakerState.CLOSED:
                    raise TargetDown(f"{self.key} is {self.state.value}") from None
                raise
            woken = True

    def done(self, grant: Grant, health: TargetHealth) -> None:
        """Hand back ``grant`` with what the attempt said about the target."""
        self.running -= 1
        if grant.probe:
            self._probing = False
        if health is TargetHealth.DOWN:
            self._failures += 1
            self._failed_at = self._owner.clock()
            if grant.probe or (self.state is BreakerState.CLOSED and self._failures >= self._policy.failures):
                self._open()
                return
        elif health is TargetHealth.UP:
            self._failures = 0
            if self.state is not BreakerState.CLOSED:
                self._interval = self._policy.interval
                self._set(BreakerState.CLOSED)
                self.wake(self._cap)  # as many as the cap lets run; each done wakes the next
                return
        self.wake(1)

    def _open(self) -> None:
        was_open = self.state is not BreakerState.CLOSED
        if was_open:
            self._interval = min(self._interval * 2, self._policy.max_interval)
        self._retry_at = self._owner.clock() + self._interval
        self._set(BreakerState.OPEN)
        self._schedule()

    def _soon(self, at: float) -> None:
        """Probe by ``at`` at the latest (an open breaker only)."""
        if at < self._retry_at:
            self._retry_at = at
            self._interval = self._policy.interval  # fresh evidence: the backoff starts over
            self._schedule()

    def _schedule(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        delay = max(0.0, self._retry_at - self._owner.clock())
        self._timer = asyncio.get_running_loop().call_later(delay, self._half_open_due)

    def hurry(self, policy: BreakerPolicy) -> None:
        """Take a shorter ``policy``; an open breaker probes within its new interval."""
        self._policy = policy
        self._interval = min(self._interval, policy.max_interval)
        if self.state is BreakerState.OPEN:
            self._retry_at = min(self._retry_at, self._owner.clock() + self._interval)
            self._schedule()

    def _half_open_due(self) -> None:
        self._timer = None
        # Due now, whatever the clock says: a loop timer may fire a tick before it.
        self._retry_at = min(self._retry_at, self._owner.clock())
        self.wake(1)  # the first waiter turns the breaker half-open and probes

    def wake(self, count: int) -> None:
        while count > 0 and self.waiting:
            waiter = self.waiting.popleft()
            if not waiter.done():
                waiter.set_result(None)
                count -= 1

    def _set(self, state: BreakerState) -> None:
        if state is self.state:
            return
        old, self.state = self.state, state
        self._owner.changed(self, old)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


class Targets:
    """Every target some live job names; bounded by ``size`` (idle targets go first)."""

    def __init__(
        self,
        cap: int,
        gauge: Gauge,
        policy: BreakerPolicy | None = None,
        size: int = 8192,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._cap = max(1, cap)
        self._policy = policy or BreakerPolicy()
        self._size = size
        self.clock = clock
        self._gauges = {state: gauge.labels(state.value) for state in BreakerState}
        self._targets: dict[str, Target] = {}
        self._counts = collections.Counter(
            {BreakerState.CLOSED: 0, BreakerState.OPEN: 0, BreakerState.HALF_OPEN: 0}
        )
        self._log_times: collections.deque[float] = collections.deque()
        self._suppressed = 0
        for state in BreakerState:
            self._publish(state)

    def __len__(self) -> int:
        return len(self._targets)

    def get(self, key: str) -> Target:
        target = self._targets.get(key)
        if target is None:
            if len(self._targets) >= self._size:
                self._evict()
            target = self._targets[key] = Target(key, self._cap, self._policy, self)
            self._counts[BreakerState.CLOSED] += 1
            self._publish(BreakerState.CLOSED)
        return target

    def attach(self, key: str) -> Target:
        """A job names ``key``: the target stays known while it has jobs."""
        target = self.get(key)
        target.jobs += 1
        return target

    def detach(self, target: Target) -> None:
        """A job is done with ``target``; with no job left naming it, it is forgotten (a later
        job to a dead P pays ``failures`` connect attempts again before its breaker opens)."""
        target.jobs -= 1
        if target.idle and self._targets.get(target.key) is target:
            self._forget(target)

    def _evict(self) -> None:
        """Make room: the idle targets go, closed ones first (an open breaker is worth keeping)."""
        idle = sorted(
            (t for t in self._targets.values() if t.idle), key=lambda t: t.state is not BreakerState.CLOSED
        )
        for target in idle[: max(1, len(idle) // 2)]:
            self._forget(target)

    def _forget(self, target: Target) -> None:
        target.close()
        del self._targets[target.key]
        self._counts[target.state] -= 1
        self._publish(target.state)

    def changed(self, target: Target, old: BreakerState) -> None:
        self._counts[old] -= 1
        self._counts[target.state] += 1
        self._publish(old)
        self._publish(target.state)
        self._log(target, old)

    def _publish(self, state: BreakerState) -> None:
        self._gauges[state].set(self._counts[state])

    def _log(self, target: Target, old: BreakerState) -> None:
        now = self.clock()
        while self._log_times and self._log_times[0] <= now - LOG_WINDOW:
            self._log_times.popleft()
        if len(self._log_times) >= LOG_BURST:
            self._suppressed += 1
            return
        self._log_times.append(now)
        suppressed, self._suppressed = self._suppressed, 0
        level = logging.WARNING if target.state is BreakerState.OPEN else logging.INFO
        log.log(
            level,
            "release target %s: %s -> %s",
            target.key,
            old.value,
            target.state.value,
            extra={"target": target.key, "state": target.state.value, "suppressed": suppressed},
        )

    def hurry(self, interval: float) -> None:
        """Shutdown is near and the flush is short: probe open targets at least every
        ``interval`` seconds from now on, so jobs waiting on a P that came back still go."""
        self._policy = dataclasses.replace(
            self._policy,
            interval=min(self._policy.interval, interval),
            max_interval=min(self._policy.max_interval, interval),
        )
        for target in self._targets.values():
            target.hurry(self._policy)

    def close(self) -> None:
        for target in self._targets.values():
            target.close()
