"""The release pipeline: bounded, de-duplicated, retried by time, isolated per target.

``submit`` never blocks and never raises: the request path hands over a job
and moves on, so a client's error answer is never delayed by a release.
Each job is a task of its own that holds a worker only while an attempt
runs: between attempts it sleeps (exponential backoff with full jitter) and
while its target's breaker is open it waits, both without a worker, until
its deadline, after which P frees the blocks itself. Attempts go through
``sidecar.release.targets``: a cap per target (a share of the workers) and a
breaker per target, so a dead P never delays another P's releases.

When more than ``queue_size`` jobs are live the oldest one not in an attempt
is dropped (counted and logged): the newest rejections have the most lease
left to save. Every job ends with exactly one "release decision" log line
and one ``kvr_releases_total`` count; retries are counted in
``kvr_release_attempts_total{reason}``, never logged above debug.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

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
from sidecar.release.targets import BreakerPolicy, Grant, Target, TargetDown, Targets

log = logging.getLogger("sidecar.release")

NOT_SENT = (JobResult.DROPPED, JobResult.REFUSED)  # nothing reached P: the parameters stay usable


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
