"""Per-target breakers and caps: state changes, probes, FIFO wake-ups, bounds, logs."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest
from prometheus_client import CollectorRegistry, Gauge

from sidecar.release import pipeline as pipeline_module
from sidecar.release.base import TargetHealth
from sidecar.release.pipeline import BreakerPolicy, BreakerState, Grant, Target, TargetDown, Targets

POLICY = BreakerPolicy(failures=3, interval=0.05, max_interval=0.2)


def make(cap: int = 2, size: int = 64, policy: BreakerPolicy = POLICY) -> tuple[Targets, CollectorRegistry]:
    registry = CollectorRegistry()
    gauge = Gauge("kvr_release_targets", "targets by state", ["state"], registry=registry)
    return Targets(cap, gauge, policy, size=size), registry


# An open interval no test waits out: only a fresh job can probe within one.
LONG = BreakerPolicy(failures=3, interval=30.0, max_interval=30.0)


def counted(registry: CollectorRegistry, state: str) -> float:
    return registry.get_sample_value("kvr_release_targets", {"state": state}) or 0.0


def never() -> None:
    raise AssertionError("the breaker was not expected to block")


async def fail(target: Target, times: int) -> None:
    for _ in range(times):
        grant = await target.acquire(time.monotonic() + 1, never)
        target.done(grant, TargetHealth.DOWN)


async def test_three_connect_failures_open_then_a_probe_closes() -> None:
    targets, registry = make()
    target = targets.attach("p:5600")
    await fail(target, 2)
    assert target.state is BreakerState.CLOSED  # two are not enough
    await fail(target, 1)
    assert target.state is BreakerState.OPEN
    assert counted(registry, "open") == 1 and counted(registry, "closed") == 0
    blocked: list[int] = []
    started = time.monotonic()
    probe = await target.acquire(time.monotonic() + 1, lambda: blocked.append(1))
    assert probe.probe and blocked == [1]  # it waited for the interval, then probed
    assert time.monotonic() - started >= POLICY.interval * 0.9
    assert target.state is BreakerState.HALF_OPEN
    # While the probe runs nobody else connects.
    second = asyncio.ensure_future(target.acquire(time.monotonic() + 1, lambda: None))
    await asyncio.sleep(0.02)
    assert not second.done()
    target.done(probe, TargetHealth.UP)
    grant = await second
    assert not grant.probe and target.state is BreakerState.CLOSED
    assert counted(registry, "closed") == 1 and counted(registry, "half_open") == 0


GAP = 0.1


@pytest.fixture
def short_gap(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pipeline_module, "FRESH_GAP", GAP)


@pytest.mark.usefixtures("short_gap")
async def test_a_job_made_after_the_last_failure_brings_the_probe_forward() -> None:
    """P came back: a request it prefilled since is the first sign. The breaker's long interval is
    cut to ``FRESH_GAP`` after the failure; one job probes, and when it connects every job goes."""
    targets, _ = make(cap=2, policy=LONG)
    target = targets.attach("p:5600")
    before = time.monotonic()
    await fail(target, 3)
    failed = time.monotonic()
    assert target.state is BreakerState.OPEN
    jobs = [asyncio.ensure_future(target.acquire(failed + 5, lambda: None, before)) for _ in range(3)]
    await asyncio.sleep(GAP * 2)
    assert not any(job.done() for job in jobs)  # made before the failure: the interval holds them
    fresh = asyncio.ensure_future(target.acquire(failed + 5, lambda: None, time.monotonic()))
    done, _ = await asyncio.wait([*jobs, fresh], timeout=1.0, return_when=asyncio.FIRST_COMPLETED)
    [probe] = [job.result() for job in done]
    assert probe.probe and target.state is BreakerState.HALF_OPEN
    target.done(probe, TargetHealth.UP)
    waiting = [job for job in (*jobs, fresh) if job not in done]
    grants = await asyncio.wait_for(asyncio.gather(*waiting[:2]), 0.1)  # the cap's worth, at once
    assert target.state is BreakerState.CLOSED and not any(g.probe for g in grants)
    target.done(grants[0], TargetHealth.UP)
    assert not (await asyncio.wait_for(waiting[2], 0.1)).probe


@pytest.mark.usefixtures("short_gap")
async def test_a_dead_p_costs_one_probe_per_gap_while_new_rejections_name_it() -> None:
    targets, _ = make(cap=2, policy=LONG)
    target = targets.attach("p:5600")
    await fail(target, 3)
    started, probes = time.monotonic(), 0
    while time.monotonic() - started < GAP * 5:
        grant = await target.acquire(time.monotonic() + 5, lambda: None, time.monotonic())
        assert grant.probe
        probes += 1
        target.done(grant, TargetHealth.DOWN)
    assert 3 <= probes <= 6  # one per FRESH_GAP at most, never one per job


async def test_a_failed_probe_doubles_the_interval_up_to_the_cap() -> None:
    targets, _ = make()
    target = targets.attach("p:5600")
    await fail(target, 3)
    waits = []
    for _ in range(4):
        started = time.monotonic()
        probe = await target.acquire(time.monotonic() + 2, lambda: None)
        waits.append(time.monotonic() - started)
        assert probe.probe
        target.done(probe, TargetHealth.DOWN)
    # 0.05 (the first open), then 0.1, 0.2, 0.2 (capped)
    assert waits[0] < waits[1] < waits[2]
    assert waits[3] == pytest.approx(waits[2], abs=0.05)
    assert waits[3] < POLICY.max_interval * 1.5


async def test_an_untouched_probe_hands_the_probe_to_the_next_job() -> None:
    targets, _ = make()
    target = targets.attach("p:5600")
    await fail(target, 3)
    first = await target.acquire(time.monotonic() + 1, lambda: None)
    waiting = asyncio.ensure_future(target.acquire(time.monotonic() + 1, lambda: None))
    await asyncio.sleep(0.01)
    target.done(first, TargetHealth.UNTOUCHED)  # refused before connecting: no news of the target
    second = await waiting
    assert second.probe and target.state is BreakerState.HALF_OPEN


async def test_open_until_the_deadline_raises_target_down() -> None:
    targets, _ = make()
    target = targets.attach("p:5600")
    await fail(target, 3)
    holder = await target.acquire(time.monotonic() + 1, lambda: None)  # the probe, never returned
    with pytest.raises(TargetDown):
        await target.acquire(time.monotonic() + 0.05, lambda: None)
    target.done(holder, TargetHealth.UP)
    assert not target.waiting  # the timed-out waiter left the line


async def test_the_cap_wakes_one_waiter_per_freed_slot_in_order() -> None:
    targets, _ = make(cap=2)
    target = targets.attach("p:5600")
    grants = [await target.acquire(time.monotonic() + 1, never) for _ in range(2)]
    order: list[int] = []

    async def wait(i: int) -> Grant:
        grant = await target.acquire(time.monotonic() + 1, never)
        order.append(i)
        return grant

    waiters = [asyncio.ensure_future(wait(i)) for i in range(5)]
    await asyncio.sleep(0.01)
    assert not order
    target.done(grants[0], TargetHealth.UP)
    await asyncio.sleep(0.01)
    assert order == [0] and target.running == 2
    for i in range(4):
        target.done(await waiters[i], TargetHealth.UP)
        await asyncio.sleep(0)
    target.done(await waiters[4], TargetHealth.UP)
    target.done(grants[1], TargetHealth.UP)
    assert order == [0, 1, 2, 3, 4] and target.running == 0


async def test_a_cancelled_waiter_leaves_the_line_and_passes_a_wake_up_on() -> None:
    targets, _ = make(cap=1)
    target = targets.attach("p:5600")
    grant = await target.acquire(time.monotonic() + 1, never)
    first = asyncio.ensure_future(target.acquire(time.monotonic() + 1, never))
    second = asyncio.ensure_future(target.acquire(time.monotonic() + 1, never))
    await asyncio.sleep(0.01)
    target.done(grant, TargetHealth.UP)  # wakes ``first``...
    first.cancel()  # ...which is cancelled before it runs: ``second`` must get the slot
    assert (await second).probe is False
    assert target.running == 1 and not target.waiting


async def test_targets_are_bounded_and_idle_closed_ones_forgotten() -> None:
    targets, registry = make(size=4)
    for i in range(10):
        target = targets.attach(f"p{i}:5600")
        targets.detach(target)  # idle and closed: nothing worth remembering
    assert len(targets) == 0
    held = [targets.attach(f"q{i}:5600") for i in range(4)]
    targets.attach("r:5600")  # over the size: only idle targets could go, none is
    assert len(targets) == 5
    for target in held:
        targets.detach(target)
    targets.attach("s:5600")
    assert len(targets) <= 4
    assert counted(registry, "closed") == len(targets)


async def test_state_changes_are_logged_at_a_bounded_rate(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "sidecar.release")
    targets, _ = make()
    for i in range(20):
        await fail(targets.attach(f"p{i}:5600"), 3)
    lines = [r for r in caplog.records if "release target" in r.getMessage()]
    assert len(lines) == 5  # LOG_BURST per window; the rest are counted, not logged


async def test_hurry_brings_an_open_breakers_probe_forward() -> None:
    targets, _ = make()
    target = targets.attach("p:5600")
    slow = BreakerPolicy(failures=1, interval=60.0, max_interval=60.0)
    target.hurry(slow)
    await fail(target, 1)
    assert target.state is BreakerState.OPEN
    targets.hurry(0.05)  # shutdown: the flush is short
    # acquire raises TargetDown at its deadline (30 s), half the slow policy's interval: a grant
    # at all shows the probe was brought forward; the rest of the 30 s is the loaded machine's margin.
    probe = await target.acquire(time.monotonic() + 30, lambda: None)
    assert probe.probe


async def test_the_probe_is_due_when_its_timer_fires_even_if_the_clock_lags() -> None:
    # asyncio may run a timer a tick before time.monotonic() reaches its deadline: the breaker
    # must not then wait for a timer that never comes again.
    registry = CollectorRegistry()
    gauge = Gauge("kvr_release_targets", "targets by state", ["state"], registry=registry)
    frozen = Targets(2, gauge, POLICY, clock=lambda: 0.0)  # a clock that never reaches retry_at
    target = frozen.attach("p:5600")
    for _ in range(3):
        target.done(await target.acquire(1.0, never), TargetHealth.DOWN)
    assert target.state is BreakerState.OPEN
    async with asyncio.timeout(1.0):
        probe = await target.acquire(1.0, lambda: None)
    assert probe.probe
