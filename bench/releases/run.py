"""``python -m bench --workload releases``: a steady rate of rejected requests through one sidecar, and
how fast P gets its blocks back.

P is ``sim-prefill`` (vLLM 0.33.0, real NIXL agents, TP 2 by default: every
release is a notification to each of its two workers; no lease, so a block is
freed only by a release). D is ``bench.servers.fakes --role reject``: it
refuses every completion with vLLM's 400 for a body that fails validation,
before its handler, which vLLM's own cleanup does not cover, so the sidecar
(``--release nixl``, 32 release workers) releases every one. Processes are
laid out as ``bench.storm`` lays them (``bench.releases.launch``): the
sidecar alone on the second core; P, D and this load generator on the first.

First the parameters are made: real prefill legs on P, each pinning one
block, as many as the run will spend. Then each step sends rejected requests
at a fixed rate (open loop: request ``i`` goes at ``t0 + i / rate`` whatever
the earlier ones' fate, over as many keep-alive connections as that takes),
each carrying one set of P's parameters. The main step is the rate the run
is named for (2,000/s for 30 s); the others, shorter, climb past it until the
sidecar stops keeping up: P frees fewer than 99 % of the step's requests
within a second of the step's end, or P's freed p99 passes 100 ms. For every
request, the time from the client having D's answer to P having freed the
blocks comes from P's own record (``POST /sim/freed``, ``time.monotonic``
on both sides). The sidecar's CPU and peak RSS are read from ``/proc``, its
release counters and backlog from its ``/metrics``.

With ``--baseline DIR`` the sidecar of another checkout runs beside this
one (same P, D and core) and every step is run on both, one after the other,
their order swapped from step to step; each waits for the other's release
backlog to drain first. With ``--profile DIR`` py-spy samples each sidecar
during the main step.

The load side is ``bench.releases.load``; the readings of ``/metrics``,
``bench.releases.metrics``; the steps' figures and the table,
``bench.releases.report``.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Callable
from pathlib import Path

import aiohttp
import msgspec

from bench.harness import profile
from bench.harness.noise import Other, loadavg, snapshot_of, wait_quiet
from bench.harness.procs import BenchError, CorePlan, rss_peak
from bench.harness.report import MB
from bench.harness.stats import ms, percentile
from bench.releases.launch import Hop, StormServers, launched, wait_ready
from bench.releases.load import OpenLoop, prepare
from bench.releases.metrics import Samples, Scrape, release_latency_ms, released, sample
from bench.releases.report import ReleasesReport, Step, line, render

__all__ = ["ReleasesReport", "ReleasesSettings", "render", "run", "settings"]

LATE = 0.1  # P's freed p99 (s) past which a step did not keep up


class ReleasesSettings(msgspec.Struct, frozen=True, kw_only=True):
    rate: float = 2000.0  # the main step's rejected requests per second
    seconds: float = 30.0
    # The steps, as (rate, seconds), before and after the main one; the run stops climbing at
    # the first step the sidecar did not keep up with.
    before: tuple[tuple[float, float], ...] = ((500.0, 2.0), (1000.0, 2.0))
    after: tuple[tuple[float, float], ...] = ((3000.0, 2.0), (4000.0, 2.0))
    tp: int = 2
    release_workers: int = 32
    release_queue_size: int = 4096
    prepare_connections: int = 48
    settle: float = 5.0  # seconds after a step for its last releases to reach P
    warmup: int = 50  # requests released (at 50/s) before the first step: P's handshake is cached
    # Before each step, wait until other processes use at most ``quiet`` cores' worth of the two
    # cores (over a second), for at most ``quiet_wait`` seconds; what was waited is reported.
    quiet: float = 0.25
    quiet_wait: float = 180.0
    ready_timeout: float = 60.0
    drain_wait: float = 40.0  # at most, for a sidecar's release backlog to drain before a step
    baseline: str = ""  # another checkout whose sidecar runs every step too ("baseline")
    profile: str = ""  # py-spy each sidecar during the main step, stacks written here


FULL = ReleasesSettings()
QUICK = ReleasesSettings(
    rate=200.0, seconds=1.0, before=((100.0, 0.5),), after=((400.0, 0.5),), settle=2.0, warmup=10,
    quiet_wait=0.0,
)  # fmt: skip


def settings(args: argparse.Namespace) -> ReleasesSettings:
    base = QUICK if args.quick else FULL
    given = {
        "rate": args.rate, "seconds": args.seconds, "quiet_wait": args.quiet_wait,
        "baseline": args.baseline, "profile": args.profile,
    }  # fmt: skip
    return msgspec.structs.replace(base, **{k: v for k, v in given.items() if v is not None})


async def step(
    servers: StormServers, plan: CorePlan, scrape: Scrape, bodies: list[tuple[str, bytes]], rate: float,
    settle: float, hop: Hop | None = None,
) -> Step:  # fmt: skip
    """One rate held for ``len(bodies) / rate`` seconds, and what P and the sidecar made of it.

    ``hop``: the sidecar the requests go through (default this tree's); ``scrape`` reads its metrics.
    """
    hop = hop or servers.hops[0]
    load = (servers.prefill, servers.decode)
    m0 = await scrape.metrics()
    await _freed(servers)  # what earlier steps left is not this one's
    cpu0, load0 = hop.child.cpu_seconds(), time.process_time() + sum(c.cpu_seconds() for c in load)
    before = snapshot_of(plan, load0, cpu0)
    sender = OpenLoop(hop.url)
    try:
        async with rss_peak(hop.child) as peak:
            wall = await sender.run(bodies, rate)
            cpu1, load1 = (
                hop.child.cpu_seconds(),
                time.process_time() + sum(c.cpu_seconds() for c in load),
            )
            after = snapshot_of(plan, load1, cpu1)
            m1 = await scrape.metrics()
            freed = await _collect(servers, {rid for rid, _ in bodies}, settle)
            m2 = await scrape.metrics()  # the releases' ends: those P recorded were all counted by now
    finally:
        sender.close()
    if sender.errors:
        raise BenchError(f"D's rejections did not come back as 400s: {sender.errors}\n{servers.logs()}")
    other = Other()
    other.add(before, after)
    latencies = [freed[rid] - answered for rid, answered in sender.answered.items() if rid in freed]
    result = _step(
        rate, wall, bodies, sender, latencies, (m0, m1, m2), (cpu1 - cpu0, load1 - load0), peak[0], other
    )
    result.hop = hop.name
    return result


def _step(
    rate: float, wall: float, bodies: list[tuple[str, bytes]], sender: OpenLoop, latencies: list[float],
    metrics: tuple[Samples, Samples, Samples], cpu: tuple[float, float], peak: int, other: Other,
) -> Step:  # fmt: skip
    """``metrics``: the sidecar's before the step, as it ended, and once P's records settled."""
    m0, m1, m2 = metrics
    results = ("dropped", "failed", "refused", "duplicate", "covered_by_engine")
    freed_p99 = ms(percentile(latencies, 99)) if latencies else float("inf")
    kept_up = len(latencies) >= 0.99 * len(bodies) and freed_p99 <= ms(LATE)
    lat = latencies or [float("inf")]
    return Step(
        rate=rate,
        seconds=wall,
        sent=len(bodies),
        answered=len(sender.answered),
        send_late_p99_ms=ms(percentile(sender.late, 99)),
        answer_p50_ms=ms(percentile(sender.answer, 50)),
        answer_p99_ms=ms(percentile(sender.answer, 99)),
        freed=len(latencies),
        freed_p50_ms=ms(percentile(lat, 50)),
        freed_p99_ms=freed_p99,
        freed_max_ms=ms(max(lat)),
        sidecar_sent=released(m0, m2, "sent"),
        sidecar_latency_p50_ms=release_latency_ms(m0, m1, 0.5),
        sidecar_latency_p99_ms=release_latency_ms(m0, m1, 0.99),
        sidecar_other={r: released(m0, m2, r) for r in results},
        backlog_end=int(sample(m1, "kvr_release_queue_depth")),
        sidecar_cores=cpu[0] / wall,
        sidecar_rss_peak_mb=peak / MB,
        load_cores=cpu[1] / wall,
        other_load_core=other.shares()[0],
        other_hop_core=other.shares()[1],
        kept_up=kept_up,
    )


async def _freed(servers: StormServers) -> dict[str, float]:
    async with aiohttp.ClientSession() as session, session.post(servers.prefill_url + "/sim/freed") as answer:
        data = await answer.json()
    return {rid: when for rid, when, cause in data["freed"] if cause == "notification"}


async def _collect(servers: StormServers, expected: set[str], settle: float) -> dict[str, float]:
    """P's freed times of ``expected``, polled until all are in or ``settle`` seconds passed."""
    found: dict[str, float] = {}
    deadline = time.monotonic() + settle
    while True:
        found |= {rid: when for rid, when in (await _freed(servers)).items() if rid in expected}
        if len(found) == len(expected) or time.monotonic() > deadline:
            return found
        await asyncio.sleep(0.1)  # poll interval


async def run(
    settings: ReleasesSettings, plan: CorePlan, progress: Callable[[str], None], quick: bool
) -> ReleasesReport:
    started = time.monotonic()
    loadavg_start = loadavg()
    plan_steps = [*settings.before, (settings.rate, settings.seconds), *settings.after]
    counts = [round(rate * seconds) for rate, seconds in plan_steps]
    baseline = Path(settings.baseline) if settings.baseline else None
    with launched(
        plan, settings.release_queue_size, settings.release_workers, settings.tp, True, baseline
    ) as servers:
        await wait_ready(servers, started + settings.ready_timeout)
        progress(f"ready: {', '.join(f'{c.name} pid {c.pid}' for c in servers.children)}")
        hops = servers.hops
        t0 = time.monotonic()
        bodies = await prepare(
            servers.prefill_url, (settings.warmup + sum(counts)) * len(hops), settings.prepare_connections
        )
        prepared = time.monotonic() - t0
        progress(f"prepared {len(bodies)} requests' parameters on P in {prepared:.1f} s")
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
            scrapes = {hop.name: Scrape(session, hop.admin_url, servers.prefill_url) for hop in hops}
            runner = _Runner(servers, plan, settings, scrapes, bodies, progress)
            for hop in hops:
                warm = await runner.next(hop, 50.0, settings.warmup)
                progress(f"warm-up, {hop.name}: " + line(warm))
            steps = await runner.climb(plan_steps, counts)
    main = len(settings.before)
    return ReleasesReport(
        quick=quick,
        cores=plan.describe(),
        settings=msgspec.structs.asdict(settings),
        seconds=time.monotonic() - started,
        prepared=(len(bodies) - settings.warmup * len(hops)) // len(hops),
        prepare_seconds=prepared,
        loadavg_start=loadavg_start,
        loadavg_end=loadavg(),
        steps=steps["sidecar"],
        main=main,
        stopped_keeping_up=_stopped(steps["sidecar"]),
        baseline=settings.baseline,
        baseline_steps=steps.get("baseline", []),
        baseline_stopped_keeping_up=_stopped(steps.get("baseline", [])),
    )


def _stopped(steps: list[Step]) -> float | None:
    missed = [s.rate for s in steps if not s.kept_up]
    return min(missed) if missed else None


class _Runner:
    """Runs the steps on every sidecar, each with its own slice of the prepared requests."""

    def __init__(
        self, servers: StormServers, plan: CorePlan, settings: ReleasesSettings, scrapes: dict[str, Scrape],
        bodies: list[tuple[str, bytes]], progress: Callable[[str], None],
    ) -> None:  # fmt: skip
        self.servers, self.plan, self.settings, self.scrapes = servers, plan, settings, scrapes
        self.bodies, self.offset, self.progress = bodies, 0, progress

    async def next(self, hop: Hop, rate: float, count: int, main: bool = False) -> Step:
        """The next ``count`` prepared requests through ``hop`` at ``rate``."""
        drained = await self._drain()
        waited = await _quiet(self.servers, self.plan, self.settings)
        bodies = self.bodies[self.offset : self.offset + count]
        self.offset += count
        sampled = None
        if main and self.settings.profile:
            out = Path(self.settings.profile) / f"profile-releases-{hop.name}.txt"
            out.parent.mkdir(parents=True, exist_ok=True)
            sampled = (out, await profile.record(hop.child.pid, count / rate, out, self.plan.load))
        scrape = self.scrapes[hop.name]
        result = await step(self.servers, self.plan, scrape, bodies, rate, self.settings.settle, hop)
        if sampled is not None:
            await sampled[1].wait()
            result.profile = profile.summary(sampled[0])
        result.waited_s, result.others_before = waited
        result.drained_s = drained
        return result

    async def climb(self, plan_steps: list[tuple[float, float]], counts: list[int]) -> dict[str, list[Step]]:
        """Every step on every sidecar (order swapped per step); a sidecar stops climbing past the main
        step at the first step it did not keep up with."""
        hops = self.servers.hops
        steps: dict[str, list[Step]] = {hop.name: [] for hop in hops}
        stopped: set[str] = set()
        main = len(self.settings.before)
        for index, ((rate, _), count) in enumerate(zip(plan_steps, counts, strict=True)):
            for hop in hops if index % 2 == 0 else hops[::-1]:
                if hop.name in stopped:
                    self.offset += count
                    continue
                result = await self.next(hop, rate, count, main=index == main)
                steps[hop.name].append(result)
                self.progress(f"{hop.name}: " + line(result))
                if index > main and not result.kept_up:
                    stopped.add(hop.name)
            if len(stopped) == len(hops):
                break
        return steps

    async def _drain(self) -> float:
        """Wait (at most ``drain_wait``) until no sidecar has release jobs live; the seconds waited."""
        began = time.monotonic()
        while time.monotonic() - began < self.settings.drain_wait:
            live = 0.0
            for scrape in self.scrapes.values():
                live += sample(await scrape.metrics(), "kvr_release_queue_depth")
            if live == 0:
                break
            await asyncio.sleep(0.2)  # poll interval
        return time.monotonic() - began


async def _quiet(servers: StormServers, plan: CorePlan, settings: ReleasesSettings) -> tuple[float, float]:
    if settings.quiet_wait <= 0:
        return 0.0, 0.0
    children = servers.children
    own = lambda: time.process_time() + sum(c.cpu_seconds() for c in children)  # noqa: E731
    return await wait_quiet(plan, own, settings.quiet, settings.quiet_wait)
