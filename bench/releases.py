"""``python -m bench --workload releases``: a steady rate of rejected requests through one sidecar, and
how fast P gets its blocks back.

P is ``sim-prefill`` (vLLM 0.33.0, real NIXL agents, TP 2 by default: every
release is a notification to each of its two workers; no lease, so a block is
freed only by a release). D is ``bench.fast_servers --role reject``: it
refuses every completion with vLLM's 400 for a body that fails validation,
before its handler, which vLLM's own cleanup does not cover, so the sidecar
(``--release nixl``, 32 release workers) releases every one. Processes are
laid out as ``bench.bench_storm`` lays them (``bench.storm_procs``): the
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
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import cast

import aiohttp
import httptools
import msgspec

from bench import profile
from bench.measure import rss_peak
from bench.noise import Other, loadavg, snapshot_of, wait_quiet
from bench.procs import BenchError, CorePlan
from bench.profile import Profile
from bench.report import MB, RunReport
from bench.stats import ms, percentile
from bench.storm_load import Samples, Scrape, release_latency_ms, released, sample
from bench.storm_procs import MODEL, Hop, StormServers, launched, wait_ready

_PROMPT = "tok tok tok tok tok tok tok tok"  # 8 words: one 16-token block on P
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


class Step(msgspec.Struct, kw_only=True):
    """One rate, held for a while: what the sidecar and P made of it."""

    rate: float  # offered, requests/s
    seconds: float
    sent: int
    answered: int  # 400s the client had back
    send_late_p99_ms: float  # how far behind schedule the load generator sent (its own health)
    answer_p50_ms: float  # the sidecar's answer, from the scheduled send
    answer_p99_ms: float
    freed: int  # of this step's requests, freed by P within ``settle`` of the step's end
    freed_p50_ms: float  # from the client having D's answer to P having freed the blocks
    freed_p99_ms: float
    freed_max_ms: float
    sidecar_sent: int  # releases the sidecar counted as sent
    # The sidecar's own part: from D's answer reaching it to the release sent (its histogram).
    sidecar_latency_p50_ms: float
    sidecar_latency_p99_ms: float
    sidecar_other: dict[str, int]  # its other release results (dropped, failed, ...)
    backlog_end: int  # release jobs queued as the step ended
    sidecar_cores: float
    sidecar_rss_peak_mb: float
    load_cores: float  # this process (the load generator), P and D together
    other_load_core: float
    other_hop_core: float
    kept_up: bool
    waited_s: float = 0.0  # waited for a quiet spell before the step
    others_before: float = 0.0  # other processes' cores' worth in the second before it began
    hop: str = "sidecar"  # which sidecar: this tree's, or "baseline" (``--baseline``)
    drained_s: float = 0.0  # waited for the sidecars' earlier release backlog to drain
    profile: Profile | None = None  # where the sidecar's CPU went (``--profile``, main step)


class ReleasesReport(RunReport, kw_only=True):
    prepared: int
    prepare_seconds: float
    loadavg_start: str
    loadavg_end: str
    steps: list[Step]
    main: int  # index of the main step
    stopped_keeping_up: float | None  # the first offered rate it did not keep up with, if any
    baseline: str = ""  # the other checkout, when one ran
    baseline_steps: list[Step] = msgspec.field(default_factory=list)  # its steps, as ``steps``
    baseline_stopped_keeping_up: float | None = None


class _Conn(asyncio.Protocol):
    """A keep-alive client connection; one request at a time, its answer to a callback."""

    def __init__(self, done: Callable[[_Conn, int, bytes], None]) -> None:
        self._done = done
        self._parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self._body: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self._parser.feed_data(data)

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self._done(self, 0, b"connection closed")  # a request on it, if any, failed

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        body, self._body = b"".join(self._body), []
        self._done(self, self._parser.get_status_code(), body)

    def send(self, route: str, body: bytes, headers: str = "") -> None:
        assert self.transport is not None
        head = f"POST {route} HTTP/1.1\r\nhost: bench\r\ncontent-type: application/json\r\n{headers}"
        self.transport.write(f"{head}content-length: {len(body)}\r\n\r\n".encode() + body)


async def _connect(url: str, done: Callable[[_Conn, int, bytes], None]) -> _Conn:
    host, _, port = url.removeprefix("http://").rpartition(":")
    _, conn = await asyncio.get_running_loop().create_connection(lambda: _Conn(done), host, int(port))
    return conn


async def prepare(prefill_url: str, count: int, connections: int) -> list[tuple[str, bytes]]:
    """``count`` prefill legs on P: (P's request id, a decode body D refuses carrying P's params)."""
    made: list[tuple[str, bytes]] = []
    left = [count]
    finished = asyncio.get_running_loop().create_future()
    body = msgspec.json.encode(
        {"model": MODEL, "prompt": _PROMPT, "max_tokens": 1,
         "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False}}
    )  # fmt: skip

    def answered(conn: _Conn, status: int, data: bytes) -> None:
        params = msgspec.json.decode(data).get("kv_transfer_params") if status == 200 else None
        if not isinstance(params, dict):
            if not finished.done():
                finished.set_exception(BenchError(f"P answered {status}: {data[:200]!r}"))
            return
        decode = {"model": MODEL, "prompt": _PROMPT, "max_tokens": "x", "kv_transfer_params": params}
        made.append((str(params["remote_request_id"]), msgspec.json.encode(decode)))
        if len(made) == count and not finished.done():
            finished.set_result(None)
        elif left[0] > 0:
            left[0] -= 1
            conn.send("/v1/completions", body)

    conns = [await _connect(prefill_url, answered) for _ in range(min(connections, count))]
    for conn in conns:
        left[0] -= 1
        conn.send("/v1/completions", body)
    try:
        await finished
    finally:
        for conn in conns:
            if conn.transport is not None:
                conn.transport.close()
    return made


class OpenLoop:
    """Sends prepared requests at a fixed rate over keep-alive connections (more when all are busy)."""

    def __init__(self, url: str) -> None:
        self._url = url
        self._idle: list[_Conn] = []
        self._all: list[_Conn] = []
        self.answered: dict[str, float] = {}  # P's request id -> when the client had the answer
        self.late: list[float] = []  # seconds each request went out behind its schedule
        self.answer: list[float] = []  # seconds from its schedule to its answer
        self.errors: list[str] = []
        self._pending: dict[_Conn, tuple[str, float]] = {}

    def _done(self, conn: _Conn, status: int, body: bytes) -> None:
        now = time.monotonic()
        pending = self._pending.pop(conn, None)
        if pending is None:  # an idle connection closed (the sidecar's keep-alive ran out)
            return
        rid, scheduled = pending
        if status == 400:
            self.answered[rid] = now
            self.answer.append(now - scheduled)
        elif len(self.errors) < 5:
            self.errors.append(f"{status}: {body[:200]!r}")
        if conn.transport is not None:
            self._idle.append(conn)

    async def run(self, bodies: list[tuple[str, bytes]], rate: float) -> float:
        """Send every body, ``1 / rate`` apart; returns when the last answer is in (or 10 s later)."""
        loop = asyncio.get_running_loop()
        start = loop.time()
        for index, (rid, body) in enumerate(bodies):
            due = start + index / rate
            if due > loop.time():
                await asyncio.sleep(due - loop.time())
            conn = await self._conn()
            self.late.append(loop.time() - due)
            self._pending[conn] = (rid, time.monotonic() - (loop.time() - due))
            conn.send("/v1/completions", body)
        deadline = loop.time() + 10
        while self._pending and loop.time() < deadline:  # noqa: ASYNC110 - answers come by callback
            await asyncio.sleep(0.01)  # poll for the last answers
        return loop.time() - start

    async def _conn(self) -> _Conn:
        """The most recently used idle connection still open, or a new one."""
        while self._idle:
            conn = self._idle.pop()
            if conn.transport is not None and not conn.transport.is_closing():
                return conn
        return await self._new()

    async def _new(self) -> _Conn:
        conn = await _connect(self._url, self._done)
        self._all.append(conn)
        return conn

    def close(self) -> None:
        for conn in self._all:
            if conn.transport is not None:
                conn.transport.close()


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
    finally:
        sender.close()
    if sender.errors:
        raise BenchError(f"D's rejections did not come back as 400s: {sender.errors}\n{servers.logs()}")
    other = Other()
    other.add(before, after)
    latencies = [freed[rid] - answered for rid, answered in sender.answered.items() if rid in freed]
    result = _step(
        rate, wall, bodies, sender, latencies, (m0, m1), (cpu1 - cpu0, load1 - load0), peak[0], other
    )
    result.hop = hop.name
    return result


def _step(
    rate: float, wall: float, bodies: list[tuple[str, bytes]], sender: OpenLoop, latencies: list[float],
    metrics: tuple[Samples, Samples], cpu: tuple[float, float], peak: int, other: Other,
) -> Step:  # fmt: skip
    m0, m1 = metrics
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
        sidecar_sent=released(m0, m1, "sent"),
        sidecar_latency_p50_ms=release_latency_ms(m0, m1, 0.5),
        sidecar_latency_p99_ms=release_latency_ms(m0, m1, 0.99),
        sidecar_other={r: released(m0, m1, r) for r in results},
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
                progress(f"warm-up, {hop.name}: " + _line(warm))
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
                self.progress(f"{hop.name}: " + _line(result))
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


def _line(s: Step) -> str:
    return (
        f"{s.rate:>6.0f}/s for {s.seconds:4.1f} s: {s.answered}/{s.sent} answered, P freed {s.freed} "
        f"(p50 {s.freed_p50_ms:.1f} ms, p99 {s.freed_p99_ms:.1f} ms), sidecar sent {s.sidecar_sent} "
        f"(its part p50 {s.sidecar_latency_p50_ms:.1f} ms, p99 {s.sidecar_latency_p99_ms:.1f} ms), "
        f"backlog {s.backlog_end}, sidecar {s.sidecar_cores:.2f} cores, {s.sidecar_rss_peak_mb:.0f} MB, "
        f"load side {s.load_cores:.2f}, others {s.other_load_core:.2f}/{s.other_hop_core:.2f} (waited "
        f"{s.waited_s:.0f} s for {s.others_before:.2f})"
        f"{'' if s.kept_up else '  NOT KEPT UP'}"
    )


def render(report: ReleasesReport) -> str:
    lines = [
        f"release throughput ({'quick' if report.quick else 'full'} run, {report.seconds:.0f} s; "
        f"{report.cores})",
        f"P: sim-prefill TP {report.settings['tp']}, {report.prepared} requests prefilled beforehand (per "
        f"sidecar) in {report.prepare_seconds:.0f} s; loadavg {report.loadavg_start} -> {report.loadavg_end}",
    ]
    runs = [("sidecar", report.steps, report.stopped_keeping_up)]
    if report.baseline:
        stop = report.baseline_stopped_keeping_up
        runs.append((f"baseline ({report.baseline})", report.baseline_steps, stop))
    for name, steps, stop in runs:
        lines += ["", name + ":", *_table(steps, report.main)]
        lines.append("stopped keeping up at: " + (f"{stop:.0f}/s" if stop else "every rate tried kept up"))
    for name, steps, _ in runs:
        for s in steps:
            if s.profile is not None:
                lines += profile.render(f"{name}, {s.rate:.0f}/s", s.profile, top=15)
    return "\n".join(lines)


def _table(steps: list[Step], main_index: int) -> list[str]:
    lines = [
        f"{'rate/s':>7} {'secs':>5} {'answered':>9} {'P freed':>8} {'freed p50':>9} {'p99':>7} {'max':>7} "
        f"{'sent':>7} {'its p50':>7} {'p99':>6} {'backlog':>7} {'CPU':>5} {'RSS MB':>6} {'load':>5} "
        f"{'others':>9} {'late p99':>8} {'drop':>6}",
    ]
    for index, s in enumerate(steps):
        mark = " <- main" if index == main_index else "" if s.kept_up else " <- not kept up"
        lines.append(
            f"{s.rate:>7.0f} {s.seconds:>5.1f} {s.answered:>9} {s.freed:>8} {s.freed_p50_ms:>9.1f} "
            f"{s.freed_p99_ms:>7.1f} {s.freed_max_ms:>7.1f} {s.sidecar_sent:>7} "
            f"{s.sidecar_latency_p50_ms:>7.1f} {s.sidecar_latency_p99_ms:>6.1f} {s.backlog_end:>7} "
            f"{s.sidecar_cores:>5.2f} {s.sidecar_rss_peak_mb:>6.0f} {s.load_cores:>5.2f} "
            f"{s.other_load_core:>4.2f}/{s.other_hop_core:.2f} {s.send_late_p99_ms:>8.1f} "
            f"{s.sidecar_other.get('dropped', 0):>6}{mark}"
        )
    main = steps[main_index] if len(steps) > main_index else None
    if main is not None:
        verdict = "PASS" if main.kept_up and main.freed_p99_ms <= 20 else "MISS"
        lines.append(
            f"target: {main.rate:.0f}/s sustained with P freed p99 <= 20 ms: {main.freed}/{main.sent} freed, "
            f"p99 {main.freed_p99_ms:.1f} ms  {verdict}"
        )
    return lines
