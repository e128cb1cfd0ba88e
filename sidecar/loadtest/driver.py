"""When flows start: open-loop Poisson arrivals, or a fixed number in flight.

Open loop (``rate``): arrival times are drawn up front from a generator
seeded by ``seed``, and each flow starts at its time whether or not earlier
ones have finished, so a slow system sees the load it would see in
production instead of a politely slowed client. Flows beyond
``max_inflight`` are not started and are counted as dropped. Fixed
concurrency: that many workers each start a new flow when theirs ends.
Both stop by themselves at ``duration`` or ``max_requests``, then wait for
the flows in flight.
"""

from __future__ import annotations

import asyncio
import itertools
import random
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from sidecar.loadtest.config import LoadConfig

StartFlow = Callable[[int], Coroutine[Any, Any, None]]


@dataclass
class DriverStats:
    """What the driver did: flows started, arrivals dropped, seconds of arrivals."""

    started: int = 0
    dropped: int = 0
    arrival_seconds: float = 0.0


def arrival_times(rate: float, duration: float, max_requests: int, seed: int) -> list[float]:
    """Poisson arrival offsets in seconds, within ``duration`` and at most ``max_requests``."""
    rng = random.Random(f"arrivals:{seed}")
    times: list[float] = []
    at = rng.expovariate(rate)
    while at <= duration and (not max_requests or len(times) < max_requests):
        times.append(at)
        at += rng.expovariate(rate)
    return times


async def drive(config: LoadConfig, start_flow: StartFlow) -> DriverStats:
    """Run ``start_flow(index)`` on the configured schedule; returns when every flow ended."""
    if config.rate > 0:
        return await _open_loop(config, start_flow)
    return await _fixed_concurrency(config, start_flow)


async def _open_loop(config: LoadConfig, start_flow: StartFlow) -> DriverStats:
    loop = asyncio.get_running_loop()
    stats = DriverStats()
    inflight: set[asyncio.Task[None]] = set()
    origin = loop.time()
    for index, at in enumerate(arrival_times(config.rate, config.duration, config.max_requests, config.seed)):
        delay = origin + at - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        if len(inflight) >= config.max_inflight:
            stats.dropped += 1
            continue
        task = asyncio.create_task(start_flow(index))
        inflight.add(task)
        task.add_done_callback(inflight.discard)
        stats.started += 1
    stats.arrival_seconds = min(config.duration, loop.time() - origin)
    if inflight:
        await asyncio.gather(*inflight)
    return stats


async def _fixed_concurrency(config: LoadConfig, start_flow: StartFlow) -> DriverStats:
    loop = asyncio.get_running_loop()
    stats = DriverStats()
    deadline = loop.time() + config.duration
    indices = itertools.count()

    async def worker() -> None:
        while loop.time() < deadline:
            index = next(indices)
            if config.max_requests and index >= config.max_requests:
                return
            stats.started += 1
            await start_flow(index)

    origin = loop.time()
    await asyncio.gather(*(worker() for _ in range(config.concurrency)))
    stats.arrival_seconds = min(config.duration, loop.time() - origin)
    return stats
