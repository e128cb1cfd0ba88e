"""The release pipeline: bounded queue, de-duplication, retries by time, isolation per target, flush."""

from __future__ import annotations

import asyncio
import collections
import time

import pytest
from prometheus_client import CollectorRegistry

from sidecar.observability.metrics import Metrics
from sidecar.release.base import (
    JobResult,
    PermanentReleaseError,
    ReleaseJob,
    RetryableReleaseError,
    TargetHealth,
)
from sidecar.release.ledger import Ledger
from sidecar.release.pipeline import BreakerPolicy, Pipeline, Retry, Settings
from tests.support.emulation import quick
from tests.support.fakes import release_params


class Down(RetryableReleaseError):
    """A connect-level failure, as PeerUnreachable is."""

    reason = "unreachable"
    health = TargetHealth.DOWN


class FakeReleaser:
    """Targets are ``remote_host``; hosts in ``dead`` refuse every attempt with ``Down``."""

    name = "fake"

    def __init__(
        self,
        failures: int = 0,
        permanent: bool = False,
        gate: asyncio.Event | None = None,
        dead: set[str] | None = None,
    ) -> None:
        self.calls: list[str] = []
        self.failures = failures
        self.permanent = permanent
        self.gate = gate
        self.dead = dead if dead is not None else set()
        self.running: collections.Counter[str] = collections.Counter()
        self.peak: collections.Counter[str] = collections.Counter()
        self.done_at: dict[str, float] = {}

    async def start(self) -> None: ...
    async def close(self) -> None: ...
    def ready(self) -> bool:
        return True

    def target(self, job: ReleaseJob) -> str:
        return job.params.remote_host or ""

    async def release(self, job: ReleaseJob) -> JobResult:
        host = self.target(job)
        self.running[host] += 1
        self.peak[host] = max(self.peak[host], self.running[host])
        try:
            return await self._release(job, host)
        finally:
            self.running[host] -= 1

    async def _release(self, job: ReleaseJob, host: str) -> JobResult:
        self.calls.append(job.params.remote_request_id or "")
        if self.gate is not None:
            await self.gate.wait()
        if host in self.dead:
            raise Down(f"{host} refused the connection")
        if self.permanent:
            raise PermanentReleaseError("not allowed", reason="not_allowed")
        if self.failures > 0:
            self.failures -= 1
            raise RetryableReleaseError("P answered badly")
        self.done_at[job.params.remote_request_id or ""] = time.monotonic()
        return JobResult.SENT


def job(rid: str, deadline: float = 5.0, engine: str = "e", host: str = "127.0.0.1") -> ReleaseJob:
    now = time.monotonic()
    params = release_params(
        {
            "do_remote_prefill": True,
            "remote_engine_id": engine,
            "remote_request_id": rid,
            "remote_host": host,
            "remote_port": 5600,
            "remote_block_ids": [1],
        }
    )
    return ReleaseJob(
        request_id=rid,
        route="/v1/completions",
        params=params,
        cause="rejected_4xx",
        detected_at=now,
        deadline=now + deadline,
    )


FAST = Retry(0.005, 0.02)
QUICK = BreakerPolicy(failures=3, interval=0.05, max_interval=0.2)


def make(
    releaser: FakeReleaser,
    queue_size: int = 100,
    workers: int = 2,
    retry: Retry = FAST,
    share: float = 1.0,
    breaker: BreakerPolicy = QUICK,
) -> tuple[Pipeline, Metrics]:
    metrics = Metrics(CollectorRegistry())
    settings = Settings(
        queue_size=queue_size, workers=workers, retry=retry, target_share=share, breaker=breaker
    )
    pipeline = Pipeline(releaser, metrics, Ledger(1000, 60), settings)
    return pipeline, metrics


def count(metrics: Metrics, result: JobResult) -> float:
    value = metrics.registry.get_sample_value(
        "kvr_releases_total", {"strategy": "fake", "result": result.value}
    )
    return value or 0.0


async def test_each_job_released_once_and_duplicates_counted() -> None:
    releaser = FakeReleaser()
    pipeline, metrics = make(releaser)
    pipeline.start()
    assert pipeline.submit(job("a"))
    assert pipeline.submit(job("b"))
    assert not pipeline.submit(job("a"))  # a client's retry
    assert pipeline.submit(job("a", engine="other-p"))  # same id on another P is another request
    assert await pipeline.flush(2)
    await pipeline.stop()
    assert sorted(releaser.calls) == ["a", "a", "b"]
    assert count(metrics, JobResult.SENT) == 3
    assert count(metrics, JobResult.DUPLICATE) == 1


async def test_retries_until_success() -> None:
    releaser = FakeReleaser(failures=3)
    pipeline, metrics = make(releaser)
    pipeline.start()
    pipeline.submit(job("a"))
    assert await pipeline.flush(2)
    await pipeline.stop()
    assert releaser.calls == ["a"] * 4
    assert count(metrics, JobResult.SENT) == 1


async def test_gives_up_at_deadline() -> None:
    releaser = FakeReleaser(failures=10**6)
    pipeline, metrics = make(releaser)
    pipeline.start()
    started = time.monotonic()
    pipeline.submit(job("a", deadline=0.2))
    # With a million failures to go, only the deadline ends the retries: flush's 3 s bound is 15
    # times the deadline, the margin for a loaded machine. It gives up once the next backoff would
    # pass the deadline, so no earlier than the deadline less one backoff.
    assert await pipeline.flush(3)
    await pipeline.stop()
    assert time.monotonic() - started >= 0.2 - FAST.cap
    assert len(releaser.calls) >= 3
    assert count(metrics, JobResult.FAILED) == 1
    assert count(metrics, JobResult.SENT) == 0


async def test_permanent_error_is_not_retried() -> None:
    releaser = FakeReleaser(permanent=True)
    pipeline, metrics = make(releaser)
    pipeline.start()
    pipeline.submit(job("a"))
    assert await pipeline.flush(2)
    await pipeline.stop()
    assert releaser.calls == ["a"]
    assert count(metrics, JobResult.REFUSED) == 1


async def test_full_queue_drops_oldest_and_never_blocks() -> None:
    gate = asyncio.Event()
    releaser = FakeReleaser(gate=gate)
    pipeline, metrics = make(releaser, queue_size=3, workers=1)
    pipeline.start()
    pipeline.submit(job("running"))
    await asyncio.sleep(0)  # let the worker take it and block on the gate
    # submit is synchronous and the running job holds the only worker until the gate opens, which
    # only this test does, after the loop: a submit that waited for room would never return.
    assert all(pipeline.submit(job(f"q{i}")) for i in range(6))
    assert releaser.calls == ["running"] and not gate.is_set()
    assert pipeline.depth == 3
    assert count(metrics, JobResult.DROPPED) == 3  # dropped within submit, before any worker ran
    gate.set()
    assert await pipeline.flush(2)
    await pipeline.stop()
    assert releaser.calls == ["running", "q3", "q4", "q5"]
    assert count(metrics, JobResult.DROPPED) == 3
    # a dropped job's key left the ledger: a retry of it can still be released
    assert pipeline.submit(job("q0"))


async def test_holds_a_key_from_submit_until_it_expires_unless_nothing_was_sent() -> None:
    # ``holds`` is what the proxy asks before forwarding parameters again: while a release is
    # queued, running or sent, D must not be sent them.
    gate = asyncio.Event()
    pipeline, _ = make(FakeReleaser(gate=gate), queue_size=1, workers=1)
    pipeline.start()
    key = job("a").key
    assert not pipeline.holds(key)
    pipeline.submit(job("a"))
    assert pipeline.holds(key)  # queued
    await asyncio.sleep(0)
    assert pipeline.holds(key)  # running
    pipeline.submit(job("b"))
    pipeline.submit(job("c"))  # the queue holds one: b is dropped, nothing sent for it
    assert not pipeline.holds(job("b").key) and pipeline.holds(job("c").key)
    gate.set()
    assert await pipeline.flush(2)
    assert pipeline.holds(key)  # sent: P may reuse the blocks
    await pipeline.stop()

    refused, _ = make(FakeReleaser(permanent=True))
    refused.start()
    refused.submit(job("r"))
    assert refused.holds(job("r").key)
    assert await refused.flush(2)
    assert not refused.holds(job("r").key)  # refused: nothing was freed, the parameters stay usable
    await refused.stop()


async def test_flush_times_out_and_stop_drops_the_rest() -> None:
    releaser = FakeReleaser(gate=asyncio.Event())
    pipeline, metrics = make(releaser, workers=1)
    pipeline.start()
    pipeline.submit(job("stuck"))
    pipeline.submit(job("queued"))
    assert not await pipeline.flush(0.05)
    await pipeline.stop()
    assert count(metrics, JobResult.DROPPED) == 2  # the stuck job and the queued one both end counted


def test_ledger_ttl_and_size() -> None:
    now = [0.0]
    ledger = Ledger(size=2, ttl=10, clock=lambda: now[0])
    assert "k" not in ledger
    assert ledger.add("k") and "k" in ledger
    now[0] = 10.0
    assert "k" not in ledger  # expired
    now[0] = 0.0
    ledger = Ledger(size=2, ttl=10, clock=lambda: now[0])
    assert ledger.add("a") and ledger.add("b")
    assert not ledger.add("a")
    assert ledger.add("c")  # evicts "a"
    assert len(ledger) == 2
    assert ledger.add("a")
    now[0] = 11
    assert ledger.add("b")  # expired
    assert len(ledger) == 1


@pytest.mark.parametrize("n", [1000])
async def test_many_jobs_all_released(n: int) -> None:
    releaser = FakeReleaser()
    pipeline, _ = make(releaser, queue_size=n, workers=4)
    pipeline.start()
    for i in range(n):
        pipeline.submit(job(str(i)))
    assert await pipeline.flush(5)
    await pipeline.stop()
    assert sorted(releaser.calls) == sorted(str(i) for i in range(n))


async def test_sent_releases_count_blocks_and_the_block_seconds_they_saved() -> None:
    releaser = FakeReleaser()
    metrics = Metrics(CollectorRegistry())
    settings = Settings(queue_size=10, workers=1, retry=Retry(0.005, 0.02), hold=lambda: 30.0)
    pipeline = Pipeline(releaser, metrics, Ledger(1000, 60), settings)
    pipeline.start()
    grouped = job("g")
    grouped = ReleaseJob(
        **{
            **{f: getattr(grouped, f) for f in grouped.__struct_fields__},
            "params": release_params(
                {
                    "do_remote_prefill": True,
                    "remote_engine_id": "e",
                    "remote_request_id": "g",
                    "remote_host": "127.0.0.1",
                    "remote_port": 5600,
                    "remote_block_ids": [[1, 2, 3], [4, 5]],
                }
            ),
        }
    )
    pipeline.submit(job("a"))  # one block
    pipeline.submit(grouped)  # five blocks over two KV-cache groups
    assert await pipeline.flush(2)
    await pipeline.stop()
    sample = metrics.registry.get_sample_value
    assert sample("kvr_released_blocks_total", {"strategy": "fake"}) == 6
    saved = sample("kvr_pinned_block_seconds_saved_total", {"strategy": "fake"})
    assert saved is not None and 6 * 29 < saved <= 6 * 30


async def test_refused_and_failed_releases_save_nothing() -> None:
    pipeline, metrics = make(FakeReleaser(permanent=True))
    pipeline.start()
    pipeline.submit(job("a"))
    assert await pipeline.flush(2)
    await pipeline.stop()
    assert metrics.registry.get_sample_value("kvr_released_blocks_total", {"strategy": "fake"}) is None


def attempts(metrics: Metrics, reason: str) -> float:
    labels = {"strategy": "fake", "reason": reason}
    return metrics.registry.get_sample_value("kvr_release_attempts_total", labels) or 0.0


def targets(metrics: Metrics, state: str) -> float:
    return metrics.registry.get_sample_value("kvr_release_targets", {"state": state}) or 0.0


async def test_a_job_waiting_to_retry_holds_no_worker() -> None:
    # One worker; the first job fails and backs off for about a second. The second job must not
    # wait for that backoff: it is sent while the first one sleeps.
    releaser = FakeReleaser(failures=1)
    pipeline, _ = make(releaser, workers=1, retry=Retry(1.0, 1.0))
    pipeline.start()
    pipeline.submit(job("slow"))
    await asyncio.sleep(0.01)  # its first attempt failed; it now sleeps without the worker
    pipeline.submit(job("quick"))
    assert await pipeline.flush(3)
    await pipeline.stop()
    assert releaser.calls == ["slow", "quick", "slow"]
    assert releaser.done_at["quick"] < releaser.done_at["slow"]


async def test_a_dead_target_opens_its_breaker_and_never_delays_a_live_one() -> None:
    # Forty jobs to a P that refuses every connection, then jobs to a live P with one worker
    # each for both. After three connect failures the dead target's breaker opens: its jobs wait
    # without a worker (counted target_down) and only a probe at growing intervals connects.
    releaser = FakeReleaser(dead={"10.0.0.1"})
    pipeline, metrics = make(releaser, workers=2, share=0.5)
    pipeline.start()
    for i in range(40):
        pipeline.submit(job(f"dead{i}", deadline=1.0, host="10.0.0.1"))
    await asyncio.sleep(0.02)
    assert targets(metrics, "open") == 1
    live_started = time.monotonic()
    for i in range(20):
        pipeline.submit(job(f"live{i}", host="10.0.0.2"))
    async with asyncio.timeout(2):
        while len([k for k in releaser.done_at if k.startswith("live")]) < 20:  # noqa: ASYNC110
            await asyncio.sleep(0.005)
    live_done = max(releaser.done_at.values()) - live_started
    dead_calls = sum(1 for c in releaser.calls if c.startswith("dead"))
    assert pipeline.live == 40  # every dead job still keeps its place
    assert await pipeline.flush(3)
    await pipeline.stop()
    # every live release went through while the dead jobs waited: none of them holds a worker
    assert quick(live_done, 0.5), live_done
    # three failures opened it; then probes at 0.05, 0.1, 0.2, 0.2... s over the 1 s deadline
    total_dead_calls = sum(1 for c in releaser.calls if c.startswith("dead"))
    assert dead_calls <= 4 and total_dead_calls <= 3 + 8, (dead_calls, total_dead_calls)
    assert releaser.peak["10.0.0.1"] == 1  # at most the cap, and only one probe at a time once open
    assert count(metrics, JobResult.FAILED) == 40
    assert count(metrics, JobResult.SENT) == 20
    assert attempts(metrics, "target_down") >= 36  # every job that found it open said so, once
    assert attempts(metrics, "unreachable") == total_dead_calls


async def test_a_probe_that_connects_closes_the_breaker_and_frees_the_waiting_jobs() -> None:
    releaser = FakeReleaser(dead={"10.0.0.1"})
    pipeline, metrics = make(releaser, workers=4)
    pipeline.start()
    for i in range(10):
        pipeline.submit(job(f"j{i}", deadline=3.0, host="10.0.0.1"))
    async with asyncio.timeout(2):
        while targets(metrics, "open") != 1:  # noqa: ASYNC110
            await asyncio.sleep(0.005)
    # no await between the count and the change: three failures opened it, then maybe failed probes
    calls_while_down = len(releaser.calls)
    releaser.dead.clear()  # P is back: the next probe connects
    assert calls_while_down >= 3 and attempts(metrics, "unreachable") == calls_while_down
    assert await pipeline.flush(2)
    await pipeline.stop()
    assert count(metrics, JobResult.SENT) == 10
    assert targets(metrics, "open") == 0 and targets(metrics, "half_open") == 0
    assert len(releaser.calls) == calls_while_down + 10  # one probe, then every waiting job once


async def test_one_target_takes_at_most_its_share_of_the_workers() -> None:
    gate = asyncio.Event()
    releaser = FakeReleaser(gate=gate)
    pipeline, _ = make(releaser, workers=4, share=0.5)
    pipeline.start()
    for i in range(10):
        pipeline.submit(job(f"busy{i}", host="10.0.0.1"))
    pipeline.submit(job("other", host="10.0.0.2"))
    await asyncio.sleep(0.02)
    assert releaser.running["10.0.0.1"] == 2  # its cap: half of four workers
    assert releaser.running["10.0.0.2"] == 1  # another target still gets a worker
    gate.set()
    assert await pipeline.flush(2)
    await pipeline.stop()
    assert releaser.peak["10.0.0.1"] == 2
    assert len(releaser.calls) == 11
