"""The release pipeline: bounded, de-duplicated, retried by time, isolated per target.

``submit`` never blocks and never raises: the request path hands over a job
and moves on, so a client's error answer is never delayed by a release.
Each job is a task of its own that holds a worker only while an attempt
runs: between attempts it sleeps (exponential backoff with full jitter) and
while its target's breaker is open it waits, both without a worker, until
its deadline, after which P frees the blocks itself. Attempts go through
their target (below): a cap per target (a share of the workers) and a
breaker per target, so a dead P never delays another P's releases.

When more than ``queue_size`` jobs are live the oldest one not in an attempt
is dropped (counted and logged): the newest rejections have the most lease
left to save. Every job ends with exactly one "release decision" log line
and one ``kvr_releases_total`` count; retries are counted in
``kvr_release_attempts_total{reason}``, never logged above debug.

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
import itertools
import logging
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum

from prometheus_client import Gauge

from sidecar.exceptions import Reason
from sidecar.observability.metrics import Children, Metrics
from sidecar.observability.tracing import OFF, Tracing
from sidecar.release.base import (
    JobResult,
    PermanentReleaseError,
    ReleaseJob,
    Releaser,
    RetryableReleaseError,
    TargetHealth,
)
from sidecar.release.hold import LEASE_SECONDS, block_seconds_saved
from sidecar.release.ledger import Ledger

log = logging.getLogger("sidecar.release")

NOT_SENT = (JobResult.DROPPED, JobResult.REFUSED)  # nothing reached P: the parameters stay usable
LOG_WINDOW = 10.0  # a target's state changes: at most LOG_BURST lines per LOG_WINDOW seconds
LOG_BURST = 5
FRESH_GAP = 0.5  # seconds after a failure before a job made since may probe


@dataclass(slots=True)
class _Live:
    """A job between ``submit`` and its one decision."""

    job: ReleaseJob
    task: asyncio.Task[None] | None = None
    attempting: bool = False
    finished: bool = False
    reason: str = ""  # the last failed attempt's reason


@dataclass(frozen=True, slots=True)
class Retry:
    """Backoff between attempts of one job: full jitter, doubling up to ``cap``."""

    initial: float
    cap: float

    def delay(self, attempt: int) -> float:
        return random.uniform(self.initial / 2, min(self.cap, self.initial * 2**attempt))


@dataclass(frozen=True, slots=True)
class Settings:
    """How the pipeline runs (``sidecar.config`` names each setting)."""

    queue_size: int = 4096  # jobs waiting at most; the oldest is dropped past it
    workers: int = 32  # attempts running at once
    retry: Retry = Retry(0.05, 1.0)
    target_share: float = 0.5  # of the workers, one target at most
    breaker: BreakerPolicy | None = None
    hold: Callable[[], float] = lambda: LEASE_SECONDS  # P's hold without a release


class Pipeline:
    """Feeds release jobs to one strategy (see the module docstring)."""

    def __init__(
        self,
        releaser: Releaser,
        metrics: Metrics,
        ledger: Ledger,
        settings: Settings,
        clock: Callable[[], float] = time.monotonic,
        tracing: Tracing = OFF,
    ) -> None:
        self.releaser = releaser
        self._tracing = tracing
        self._metrics = metrics
        self._queue_size = settings.queue_size
        self._retry = settings.retry
        self._ledger = ledger
        self._clock = clock
        self._hold = settings.hold  # P's hold without a release (sidecar.release.hold)
        workers = settings.workers
        self._workers = asyncio.Semaphore(workers)
        cap = math.ceil(workers * settings.target_share)
        self.targets = Targets(cap, metrics.release_targets, settings.breaker, clock=clock)
        self._jobs: dict[int, _Live] = {}  # in submit order
        self._attempting = 0
        self._seq = itertools.count()
        self._started = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._released = Children(metrics.releases)
        self._attempts = Children(metrics.release_attempts)
        self._latency = Children(metrics.release_latency)
        self._blocks = Children(metrics.released_blocks)
        self._saved = Children(metrics.block_seconds_saved)
        self._gauges_due = False

    @property
    def depth(self) -> int:
        """Jobs waiting: for their first attempt, a retry, a worker or their target."""
        return len(self._jobs) - self._attempting

    @property
    def live(self) -> int:
        """Jobs not decided yet (waiting or in an attempt)."""
        return len(self._jobs)

    def holds(self, key: tuple[str, str]) -> bool:
        """A release of ``key`` is live, or finished within the ledger's TTL.

        A job dropped from a full queue, or refused by the strategy, is forgotten (nothing
        was sent), so it is not held.
        """
        return key in self._ledger

    def submit(self, job: ReleaseJob) -> bool:
        """Start ``job`` unless its key was seen before. Never blocks."""
        if not self._ledger.add(job.key):
            self._finish(_Live(job), JobResult.DUPLICATE, "duplicate of an earlier release")
            return False
        if job.covered:  # D's engine releases it: recorded (the key held), never sent
            self._finish(_Live(job), JobResult.COVERED_BY_ENGINE, "D's engine releases it itself")
            return True
        if self.depth >= self._queue_size:
            self._drop_oldest()
        live = _Live(job)
        seq = next(self._seq)
        self._jobs[seq] = live
        live.task = asyncio.get_running_loop().create_task(self._drive(seq, live), name="kvr-release")
        self._idle.clear()
        self._gauges()
        return True

    def _drop_oldest(self) -> None:
        for seq, live in self._jobs.items():
            if not live.attempting:
                del self._jobs[seq]
                self._finish(live, JobResult.DROPPED, "release queue full, oldest job dropped")
                if live.task is not None:
                    live.task.cancel()
                return

    def start(self) -> None:
        self._started.set()

    def hurry(self) -> None:
        """Shutdown: open breakers probe at least every ``retry.cap`` seconds during the flush."""
        self.targets.hurry(self._retry.cap)

    async def flush(self, timeout: float) -> bool:  # noqa: ASYNC109 - a bound, not a cancel scope
        """Wait up to ``timeout`` for every live job; True when all finished."""
        try:
            async with asyncio.timeout(timeout):
                await self._idle.wait()
            return True
        except TimeoutError:
            log.warning("release flush timed out", extra={"live": len(self._jobs)})
            return False

    async def stop(self) -> None:
        """Cancel every live job; each ends ``dropped`` (nothing more is sent)."""
        tasks = [live.task for live in self._jobs.values() if live.task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.targets.close()

    # --- one job ---------------------------------------------------------------------------

    async def _drive(self, seq: int, live: _Live) -> None:
        try:
            await self._started.wait()
            if self._tracing.enabled:
                with self._tracing.release_span(live.job, self.releaser.name):
                    await self._run(live)
            else:
                await self._run(live)
        except asyncio.CancelledError:
            self._finish(live, JobResult.DROPPED, "sidecar stopped before the release was sent")
        except Exception as exc:  # a pipeline bug must not leave the job undecided
            log.exception("release job failed unexpectedly", extra={"request_id": live.job.request_id})
            self._finish(live, JobResult.FAILED, f"unexpected error: {exc!r}", reason=Reason.BUG)
        finally:
            self._jobs.pop(seq, None)
            if not self._jobs:
                self._idle.set()
            self._gauges()

    async def _run(self, live: _Live) -> None:
        job = live.job
        wait = job.not_before - self._clock()
        if wait > 0:  # after D's own notifications would have gone out
            await asyncio.sleep(wait)
        target = self.targets.attach(self.releaser.target(job))
        try:
            attempt = 0
            while not await self._attempt(live, target):
                delay = self._retry.delay(attempt)
                if self._clock() + delay >= job.deadline:
                    self._finish(live, JobResult.FAILED, "gave up at the deadline", reason=live.reason)
                    return
                await asyncio.sleep(delay)  # holds no worker and no target slot
                attempt += 1
        finally:
            self.targets.detach(target)

    async def _attempt(self, live: _Live, target: Target) -> bool:
        """One attempt; True when the job is decided, False to retry it later."""
        job = live.job
        try:
            grant = await target.acquire(
                job.deadline, lambda: self._count_attempt(Reason.TARGET_DOWN), job.detected_at
            )
        except TargetDown:
            detail = "P's endpoint stayed unreachable (its breaker open) until the deadline"
            self._finish(live, JobResult.FAILED, detail, reason=Reason.TARGET_DOWN)
            return True
        except TimeoutError:
            self._finish(live, JobResult.FAILED, "deadline passed before an attempt", reason=Reason.DEADLINE)
            return True
        health = TargetHealth.UNTOUCHED
        try:
            result, health = await self._call(live, grant)
        except _Retry as exc:
            health = exc.health
            return False
        finally:
            if live.attempting:
                live.attempting = False
                self._attempting -= 1
            target.done(grant, health)
            self._gauges()
        if result is not None:
            self._count_attempt("ok")
            self._finish(live, result, "done")
        return True

    async def _call(self, live: _Live, grant: Grant) -> tuple[JobResult | None, TargetHealth]:
        """The strategy's attempt under a worker, bounded by the deadline; raises ``_Retry``."""
        job = live.job
        try:
            async with asyncio.timeout(max(0.0, job.deadline - self._clock())):
                async with self._workers:
                    self._attempting += 1
                    live.attempting = True
                    self._gauges()
                    result = await self.releaser.release(job)
            return result, TargetHealth.UP if result is JobResult.SENT else TargetHealth.UNTOUCHED
        except PermanentReleaseError as exc:
            self._count_attempt(exc.reason)
            self._finish(live, JobResult.REFUSED, str(exc), reason=exc.reason)
            return None, exc.health
        except RetryableReleaseError as exc:
            self._count_attempt(exc.reason)
            live.reason = exc.reason
            log.debug("release attempt failed", extra={"request_id": job.request_id, "error": str(exc)})
            raise _Retry(exc.health) from exc
        except TimeoutError:
            self._count_attempt(Reason.DEADLINE)
            reason = live.reason or Reason.DEADLINE
            self._finish(live, JobResult.FAILED, "deadline passed during an attempt", reason=reason)
            return None, TargetHealth.DOWN if grant.probe else TargetHealth.UNTOUCHED
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise  # this job is being dropped or the pipeline stopped
            # A cancellation that is not ours (a shared handshake another job abandoned): retry.
            self._count_attempt(Reason.CANCELLED)
            live.reason = Reason.CANCELLED
            raise _Retry(TargetHealth.UNTOUCHED) from None
        except Exception as exc:  # a strategy bug must not kill the job's task
            log.exception("release strategy raised unexpectedly", extra={"request_id": job.request_id})
            self._count_attempt(Reason.BUG)
            self._finish(live, JobResult.FAILED, f"unexpected error: {exc!r}", reason=Reason.BUG)
            return None, TargetHealth.UNTOUCHED

    # --- accounting ------------------------------------------------------------------------

    def _count_attempt(self, reason: str) -> None:
        self._attempts(self.releaser.name, reason).inc()
        if self._tracing.enabled:
            self._tracing.release_attempt(reason)

    def _gauges(self) -> None:
        """The gauges change: published once, after the callbacks ready now (a job changes
        them several times on its way; a scrape runs in a callback of its own)."""
        if not self._gauges_due:
            self._gauges_due = True
            asyncio.get_running_loop().call_soon(self._publish)

    def _publish(self) -> None:
        self._gauges_due = False
        self._metrics.queue_depth.set(self.depth)
        self._metrics.ledger_size.set(len(self._ledger))

    def _finish(self, live: _Live, result: JobResult, detail: str, reason: str = "") -> None:
        if live.finished:
            return
        live.finished = True
        job, strategy = live.job, self.releaser.name
        if result in NOT_SENT:
            self._ledger.discard(job.key)
        self._released(strategy, result.value).inc()
        if self._tracing.enabled:
            self._tracing.release_finished(result.value, reason, detail)
        if result in (JobResult.SENT, JobResult.DRY_RUN):
            self._count_value(job, result)
        level = logging.INFO if result not in (JobResult.FAILED, JobResult.DROPPED) else logging.WARNING
        if not log.isEnabledFor(level):
            return
        log.log(
            level,
            "release decision",
            extra={
                "request_id": job.request_id,
                "remote_request_id": job.params.remote_request_id,
                "remote_engine_id": job.params.remote_engine_id,
                "cause": job.cause,
                "injected": job.injected,
                "strategy": strategy,
                "result": result.value,
                "reason": reason,
                "detail": detail,
            },
        )

    def _count_value(self, job: ReleaseJob, result: JobResult) -> None:
        strategy = self.releaser.name
        took = self._clock() - job.detected_at
        self._latency(strategy).observe(took)
        if result is JobResult.SENT:
            blocks = job.params.blocks
            self._blocks(strategy).inc(blocks)
            self._saved(strategy).inc(block_seconds_saved(blocks, self._hold(), took))


class _Retry(Exception):
    """An attempt failed in a way worth retrying; carries what it said about the target."""

    def __init__(self, health: TargetHealth) -> None:
        super().__init__(health.value)
        self.health = health


# --- per target: a cap and a breaker (see the module docstring) ----------------------------


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
