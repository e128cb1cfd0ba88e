"""The release pipeline: a bounded queue, a few workers, retries, de-duplication.

``submit`` never blocks and never raises: the request path hands over a job
and moves on, so a client's error answer is never delayed by a release.
When the queue is full the oldest job is dropped (counted and logged): the
newest rejections have the most lease left to save. Workers call the
strategy, retrying ``RetryableReleaseError`` with exponential backoff and
full jitter until the job's deadline, after which P frees the blocks itself.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import random
import time
from collections.abc import Callable

from sidecar.metrics import Metrics
from sidecar.release.base import (
    PermanentReleaseError,
    ReleaseJob,
    Releaser,
    Result,
    RetryableReleaseError,
)
from sidecar.release.ledger import Ledger
from sidecar.release.value import LEASE_SECONDS, block_count, block_seconds_saved
from sidecar.tracing import OFF, Tracing

log = logging.getLogger("sidecar.release")


class Pipeline:
    """Feeds release jobs to one strategy."""

    def __init__(
        self,
        releaser: Releaser,
        metrics: Metrics,
        *,
        queue_size: int,
        workers: int,
        retry_initial: float,
        retry_max: float,
        ledger: Ledger,
        clock: Callable[[], float] = time.monotonic,
        tracing: Tracing = OFF,
        hold: Callable[[], float] = lambda: LEASE_SECONDS,
    ) -> None:
        self._hold = hold  # P's hold without a release (sidecar.release.value)
        self.releaser = releaser
        self._tracing = tracing
        self._metrics = metrics
        self._queue: collections.deque[ReleaseJob] = collections.deque()
        self._queue_size = queue_size
        self._workers = workers
        self._retry = (retry_initial, retry_max)
        self._ledger = ledger
        self._clock = clock
        self._wakeup = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._busy = 0
        self._running: dict[int, ReleaseJob] = {}  # by id(): jobs hold lists, so are unhashable
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def depth(self) -> int:
        return len(self._queue)

    def holds(self, key: tuple[str, str]) -> bool:
        """A release of ``key`` is queued, running, or was finished within the ledger's TTL.

        A job dropped from a full queue, or refused by the strategy, is forgotten (nothing
        was sent), so it is not held.
        """
        return key in self._ledger

    def submit(self, job: ReleaseJob) -> bool:
        """Queue ``job`` unless its key was seen before. Never blocks."""
        if not self._ledger.add(job.key):
            self._finish(job, Result.DUPLICATE, "duplicate of an earlier release")
            return False
        if len(self._queue) >= self._queue_size:
            dropped = self._queue.popleft()
            self._ledger.discard(dropped.key)
            self._finish(dropped, Result.DROPPED, "release queue full, oldest job dropped")
        self._queue.append(job)
        self._idle.clear()
        self._metrics.queue_depth.set(len(self._queue))
        self._metrics.ledger_size.set(len(self._ledger))
        self._wakeup.set()
        return True

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._worker(), name=f"release-{i}") for i in range(self._workers)]

    async def flush(self, timeout: float) -> bool:  # noqa: ASYNC109 - a bound, not a cancel scope
        """Wait up to ``timeout`` for queued and running jobs; True when all finished."""
        try:
            async with asyncio.timeout(timeout):
                await self._idle.wait()
            return True
        except TimeoutError:
            log.warning("release flush timed out", extra={"queued": len(self._queue), "running": self._busy})
            return False

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        # Jobs cut off mid-retry and jobs still queued: each ends with a decision and a count.
        for job in [*self._running.values(), *self._queue]:
            self._finish(job, Result.DROPPED, "sidecar stopped before the release was sent")
        self._running.clear()
        self._queue.clear()

    async def _worker(self) -> None:
        while True:
            if not self._queue:
                if self._busy == 0:
                    self._idle.set()
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            job = self._queue.popleft()
            self._metrics.queue_depth.set(len(self._queue))
            self._busy += 1
            self._running[id(job)] = job
            try:
                if self._tracing.enabled:
                    with self._tracing.release_span(job, self.releaser.name):
                        await self._run(job)
                else:
                    await self._run(job)
                self._running.pop(id(job), None)
            finally:
                self._busy -= 1
                if not self._queue and self._busy == 0:
                    self._idle.set()

    async def _run(self, job: ReleaseJob) -> None:
        attempt = 0
        while True:
            remaining = job.deadline - self._clock()
            if remaining <= 0:
                self._finish(job, Result.FAILED, "deadline passed before the release was sent")
                return
            try:
                async with asyncio.timeout(remaining):
                    result = await self.releaser.release(job)
            except PermanentReleaseError as exc:
                self._attempt(exc.reason)
                # Nothing was freed: the parameters stay usable, so the key is forgotten.
                self._ledger.discard(job.key)
                self._finish(job, Result.REFUSED, str(exc), reason=exc.reason)
                return
            except asyncio.CancelledError as exc:
                task = asyncio.current_task()
                if task is not None and task.cancelling():
                    raise  # this worker is being stopped
                # A cancellation that is not ours (a shared handshake another job abandoned): retry.
                if not await self._retry_or_fail(job, RetryableReleaseError(f"cancelled: {exc!r}"), attempt):
                    return
            except (RetryableReleaseError, TimeoutError) as exc:
                if not await self._retry_or_fail(job, exc, attempt):
                    return
            except Exception as exc:  # a strategy bug must not kill the worker
                log.exception("release strategy raised unexpectedly", extra={"request_id": job.request_id})
                self._attempt("bug")
                self._finish(job, Result.FAILED, f"unexpected error: {exc!r}", reason="bug")
                return
            else:
                self._attempt("ok")
                self._finish(job, result, "done")
                return
            attempt += 1

    async def _retry_or_fail(self, job: ReleaseJob, exc: BaseException, attempt: int) -> bool:
        """Count a failed attempt; sleep the backoff and return True, or finish the job as failed."""
        reason = getattr(exc, "reason", "timeout")
        self._attempt(reason)
        delay = self._backoff(attempt)
        if self._clock() + delay >= job.deadline:
            self._finish(job, Result.FAILED, f"gave up at the deadline: {exc}", reason=reason)
            return False
        log.debug("release attempt failed, retrying", extra={"request_id": job.request_id, "error": str(exc)})
        await asyncio.sleep(delay)
        return True

    def _backoff(self, attempt: int) -> float:
        initial, cap = self._retry
        return random.uniform(initial / 2, min(cap, initial * 2**attempt))

    def _attempt(self, outcome: str) -> None:
        self._metrics.release_attempts.labels(self.releaser.name, outcome).inc()
        if self._tracing.enabled:
            self._tracing.release_attempt(outcome)

    def _finish(self, job: ReleaseJob, result: Result, detail: str, reason: str = "") -> None:
        strategy = self.releaser.name
        self._metrics.releases.labels(strategy, result.value).inc()
        if self._tracing.enabled:
            self._tracing.release_finished(result.value, reason, detail)
        if result in (Result.SENT, Result.DRY_RUN):
            took = self._clock() - job.detected_at
            self._metrics.release_latency.labels(strategy).observe(took)
            if result is Result.SENT:
                blocks = block_count(job.params)
                self._metrics.released_blocks.labels(strategy).inc(blocks)
                saved = block_seconds_saved(blocks, self._hold(), took)
                self._metrics.block_seconds_saved.labels(strategy).inc(saved)
        self._metrics.ledger_size.set(len(self._ledger))
        level = logging.INFO if result not in (Result.FAILED, Result.DROPPED) else logging.WARNING
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
