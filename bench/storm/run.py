"""Releases per second sustained in a rejection storm, and what the storm does to the other requests.

    python -m bench.storm [--quick] [--json out/bench-storm.json] [--release-workers N]

Three child processes, started and pinned as ``python -m bench`` does (each
in its own session; the sidecar alone on the second CPU, the rest on the
first): the simulated prefill node P (vLLM 0.33.0, TP 1, 200,000 blocks, no
lease, so a block is freed only by a release and every release is seen in
P's ``/stats``), the simulated decode node D, and the sidecar in front of D
with ``--release nixl``. The storm comes from a generator process of its
own (``bench.storm.worker``), which first runs real prefill legs on P to get
``kv_transfer_params`` that pin blocks.

Every storm request carries one set of P's parameters and a body D refuses
before its handler (``max_tokens: "x"``, a 400 from validation): vLLM
0.33.0's own cleanup covers only rejections inside the handler, so the
sidecar releases every one over NIXL.

Phases, in order, after a warm-up (the other requests, then a small release
storm drained to the end: P's handshake is cached and the storm's rate is
estimated, which sizes how many parameters to prepare):

1. baseline: the other requests alone, ``normal_connections`` closed loops of
   admitted JSON chat completions through the sidecar;
2. storm: the same, while the generator sends the prepared rejections over
   ``storm_connections`` closed loops as fast as they are answered, until
   they are spent or the phase's time is up; only the other requests sent
   inside the storm's window count. Then the release backlog is drained
   (bounded);
3. storm without releases: the same storm, bodies without
   ``kv_transfer_params``, for as long as the storm took: D rejects every one
   and the sidecar releases nothing, so storm vs this is what the releases
   themselves cost the other requests.

Releases sustained are counted by P (``freed_by_notification``) and by the
sidecar (``kvr_releases_total{strategy="nixl",result="sent"}``) over the
storm's window; dropped jobs, the backlog and the release latency
(``kvr_release_latency_seconds``, from buckets) come from the sidecar's
``/metrics``. ``--release-workers`` sets the sidecar's release workers
(default: its own default, 4). Exit 0 when the run completed, 1 when the benchmark itself
broke (a server would not start, an answer was wrong, no release reached
P), 130 on Ctrl-C.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import msgspec

from bench.harness.main import bench_parser, run_and_report
from bench.harness.noise import Other, Snapshot, snapshot_of
from bench.harness.procs import BenchError, CorePlan, cpu_seconds
from bench.harness.report import environment, other_cpu
from bench.harness.settings import Knobs
from bench.releases.launch import MODEL, StormServers, launched, wait_ready
from bench.releases.metrics import Samples, Scrape, release_jobs, released
from bench.storm.load import NormalLoad, StormWorker, Timed
from bench.storm.report import (
    Counts,
    Figures,
    LoadFigures,
    ReleaseFigures,
    Storm,
    StormReport,
    line,
    load_figures,
    ratios,
    release_figures,
    render,
)

DEFAULT_JSON = Path("out/bench-storm.json")


class StormSettings(Knobs, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The rejection-storm bench's knobs."""

    normal_connections: int = 8
    storm_connections: int = 32
    # Seconds of each measured phase (baseline, storm at most, storm without releases).
    phase_seconds: float
    # The other requests, unmeasured, before anything else.
    warmup_seconds: float
    # Rejections of the warm-up storm (released and drained before anything is measured).
    warmup_storm: int
    # Parameters prepared for the storm: the warm-up storm's rate x phase_seconds x this, at most max_params.
    params_margin: float = 1.6
    max_params: int
    # Longest time spent preparing them (a busy machine prepares slowly; the storm then ends early).
    prepare_bound: float
    # Longest wait for the release backlog after the storm.
    drain_timeout: float
    # The sidecar's release pipeline (its defaults).
    release_queue_size: int = 4096
    release_workers: int = 4


FULL = StormSettings(
    phase_seconds=8.0, warmup_seconds=1.0, warmup_storm=1000, max_params=60_000, prepare_bound=6.0,
    drain_timeout=10.0,
)  # fmt: skip


QUICK = StormSettings(
    phase_seconds=1.2, warmup_seconds=0.5, warmup_storm=300, max_params=8_000, prepare_bound=2.0,
    drain_timeout=5.0,
)  # fmt: skip


Progress = Callable[[str], None]


@dataclass(frozen=True, slots=True)
class _Cpu:
    """Both cores' busy time beside the benchmark's own (``noise.Snapshot``), and the sidecar's CPU."""

    cores: Snapshot
    sidecar: float  # the sidecar's own CPU seconds, wherever it ran


class _Bench:
    """The phases, on running servers, a running storm generator and the other requests' client."""

    def __init__(
        self,
        settings: StormSettings,
        plan: CorePlan,
        servers: StormServers,
        normal: NormalLoad,
        worker: StormWorker,
        scrape: Scrape,
        progress: Progress,
    ) -> None:
        self.settings, self.plan, self.servers = settings, plan, servers
        self.normal, self.worker, self.scrape, self.progress = normal, worker, scrape, progress
        self.other: dict[str, Other] = {}  # other processes' CPU, by phase

    async def run(self) -> tuple[Figures, Counts]:
        rate = await self._warm_up()
        wanted = min(
            self.settings.max_params,
            math.ceil(rate * self.settings.phase_seconds * self.settings.params_margin),
        )
        await self._prepare(max(wanted, self.settings.warmup_storm), self.settings.prepare_bound)
        baseline = await self._baseline()
        storm, timed, cpu, (releases, counts) = await self._storm()
        storm_figures = self._load_figures(timed.within(storm.started, storm.ended), storm.seconds, cpu)
        self.progress(line("storm", storm_figures, storm))
        control, c_timed, c_cpu = await self._control(storm.seconds)
        control_figures = self._load_figures(
            c_timed.within(control.started, control.ended), control.seconds, c_cpu
        )
        self.progress(line("storm w/o releases", control_figures, control))
        figures = Figures(
            baseline=baseline,
            storm=storm_figures,
            storm_no_release=control_figures,
            ratios=ratios(baseline, storm_figures, control_figures),
            storm_rate=storm.rate(),
            no_release_storm_rate=control.rate(),
            releases=releases,
        )
        return figures, counts

    # -- phases ------------------------------------------------------------------

    async def _warm_up(self) -> float:
        """Open every connection, cache P's handshake; the storm's rate without other load."""
        self._check(await self.normal.run_for(self.settings.warmup_seconds), "warm-up")
        await self._prepare(self.settings.warmup_storm, self.settings.prepare_bound)
        stats, metrics = await self.scrape.prefill_stats(), await self.scrape.metrics()
        storm = await self._run_storm(release=True, count=self.settings.warmup_storm)
        await self._drain(stats, metrics, storm.rejections)
        self.progress(
            f"warm-up storm: {storm.rejections} rejections at {storm.rejections / storm.seconds:.0f}/s"
        )
        return storm.rejections / storm.seconds

    async def _prepare(self, count: int, bound: float) -> None:
        """``count`` prefill legs on P, or as many as ``bound`` seconds allow (the storm then ends early)."""
        await self.worker.send({"cmd": "prepare", "count": count, "bound": bound})
        answer = await self.worker.receive(within=bound + self.settings.request_timeout + 10.0)
        if answer["errors"] or not answer["prepared"]:
            raise BenchError(
                f"prefill legs on P: {answer['prepared']} of {count} prepared, "
                f"{answer['errors']} failed; first: {answer['first_errors']}\n{self.servers.logs()}"
            )
        prepared, seconds = answer["prepared"], answer["seconds"]
        bounded = f" (of {count}: stopped by its time bound)" if prepared < count else ""
        self.progress(f"prepared {prepared} sets of kv_transfer_params on P in {seconds:.1f} s{bounded}")

    async def _baseline(self) -> LoadFigures:
        before = self._cpu()
        timed = await self.normal.run_for(self.settings.phase_seconds)
        after = self._cpu()
        self._check(timed, "baseline")
        self.other["baseline"] = _other(before, after)
        figures = self._load_figures(
            [s for _, s in timed.samples], after.cores.at - before.cores.at, (before, after)
        )
        self.progress(line("baseline", figures, None))
        return figures

    async def _storm(self) -> tuple[Storm, Timed, tuple[_Cpu, _Cpu], tuple[ReleaseFigures, Counts]]:
        """The release storm beside the other requests, then its drain."""
        stats_before, metrics_before = await self.scrape.prefill_stats(), await self.scrape.metrics()
        stop = asyncio.Event()
        cpu_before = self._cpu()
        normal = asyncio.create_task(self.normal.run(stop))
        try:
            storm = await self._run_storm(release=True, count=self.settings.max_params)
            cpu_after = self._cpu()
            stats_end, metrics_end = await self.scrape.prefill_stats(), await self.scrape.metrics()
        finally:
            stop.set()
            timed = await normal
        self._check(timed, "storm")
        self.other["storm"] = _other(cpu_before, cpu_after)
        drained = await self._drain(stats_before, metrics_before, storm.rejections)
        stats_after, metrics_after = await self.scrape.prefill_stats(), await self.scrape.metrics()
        releases = self._releases(
            storm,
            drained,
            (stats_before, stats_end, stats_after),
            (metrics_before, metrics_end, metrics_after),
        )
        return storm, timed, (cpu_before, cpu_after), releases

    async def _control(self, seconds: float) -> tuple[Storm, Timed, tuple[_Cpu, _Cpu]]:
        """The same storm without parameters, for ``seconds``: rejections, nothing to release."""
        metrics_before = await self.scrape.metrics()
        stop = asyncio.Event()
        cpu_before = self._cpu()
        normal = asyncio.create_task(self.normal.run(stop))
        try:
            storm = await self._run_storm(release=False, bound=seconds)
            cpu_after = self._cpu()
        finally:
            stop.set()
            timed = await normal
        self._check(timed, "storm without releases")
        self.other["storm_no_release"] = _other(cpu_before, cpu_after)
        if jobs := release_jobs(metrics_before, await self.scrape.metrics()):
            raise BenchError(f"the storm without kv_transfer_params made {jobs:.0f} release job(s)")
        return storm, timed, (cpu_before, cpu_after)

    # -- pieces ------------------------------------------------------------------

    async def _run_storm(self, *, release: bool, count: int = 0, bound: float | None = None) -> Storm:
        seconds = self.settings.phase_seconds if bound is None else bound
        await self.worker.send({"cmd": "storm", "release": release, "count": count, "bound": seconds})
        await self.worker.receive(within=30.0)  # "started"
        done = await self.worker.receive(within=seconds + self.settings.request_timeout + 30.0)
        statuses: dict[str, int] = done["statuses"]
        if done["errors"] or set(statuses) != {"400"}:
            raise BenchError(
                f"storm: answers {statuses}, {done['errors']} failed; expected only 400s; "
                f"first: {done['first_errors']}\n{self.servers.logs()}"
            )
        return Storm(done["started"], done["ended"], statuses["400"], done["unused"])

    async def _drain(self, stats_before: dict[str, Any], metrics_before: Samples, rejections: int) -> float:
        """Seconds until the sidecar finished a job for every rejection and P confirmed every one
        sent (or ``drain_timeout``: what is still missing is reported as unconfirmed)."""
        started = time.monotonic()
        while True:
            stats, metrics = await self.scrape.prefill_stats(), await self.scrape.metrics()
            freed = stats["freed_by_notification"] - stats_before["freed_by_notification"]
            sent = released(metrics_before, metrics, "sent")
            jobs = release_jobs(metrics_before, metrics)
            elapsed = time.monotonic() - started
            if (jobs >= rejections and freed >= sent) or elapsed > self.settings.drain_timeout:
                return elapsed
            await asyncio.sleep(0.02)  # poll interval

    def _releases(
        self,
        storm: Storm,
        drain_seconds: float,
        stats: tuple[dict[str, Any], dict[str, Any], dict[str, Any]],
        metrics: tuple[Samples, Samples, Samples],
    ) -> tuple[ReleaseFigures, Counts]:
        if stats[1]["freed_by_notification"] <= stats[0]["freed_by_notification"]:
            raise BenchError(f"no release reached P during the storm\n{self.servers.logs()}")
        return release_figures(storm, drain_seconds, stats, metrics)

    def _cpu(self) -> _Cpu:
        s = self.servers
        load = sum(cpu_seconds(pid) for pid in (self.worker.pid, s.prefill.pid, s.decode.pid))
        sidecar = cpu_seconds(s.sidecar.pid)
        return _Cpu(snapshot_of(self.plan, time.process_time() + load, sidecar), sidecar)

    def _load_figures(self, latencies: list[float], seconds: float, cpu: tuple[_Cpu, _Cpu]) -> LoadFigures:
        before, after = cpu
        return load_figures(
            latencies, seconds, (after.sidecar - before.sidecar) / (after.cores.at - before.cores.at)
        )

    def _check(self, timed: Timed, what: str) -> None:
        if timed.errors:
            raise BenchError(
                f"{what}: {timed.errors} other request(s) failed; first: {timed.first_errors}\n"
                f"{self.servers.logs()}"
            )
        if not timed.samples:
            raise BenchError(f"{what}: no other request completed\n{self.servers.logs()}")


def _other(before: _Cpu, after: _Cpu) -> Other:
    other = Other()
    other.add(before.cores, after.cores)
    return other


def _cores(plan: CorePlan) -> str:
    return plan.describe("load generators + P + D")


async def run(settings: StormSettings, plan: CorePlan, quick: bool, progress: Progress) -> StormReport:
    started, loadavg_start = time.monotonic(), os.getloadavg()[0]
    with (
        tempfile.TemporaryDirectory(prefix="kvr-bench-storm-worker-") as tmp,
        launched(plan, settings.release_queue_size, settings.release_workers) as servers,
    ):
        await wait_ready(servers, started + settings.ready_timeout)
        progress(
            f"ready: P pid {servers.prefill.pid}, D pid {servers.decode.pid}, sidecar pid "
            f"{servers.sidecar.pid}; {_cores(plan)}"
        )
        async with (
            NormalLoad(
                servers.sidecar_url, MODEL, settings.normal_connections, settings.request_timeout
            ) as normal,
            StormWorker(
                servers.prefill_url, servers.sidecar_url, MODEL, settings.storm_connections, Path(tmp)
            ) as worker,
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10.0)) as http,
        ):
            bench = _Bench(
                settings,
                plan,
                servers,
                normal,
                worker,
                Scrape(http, servers.admin_url, servers.prefill_url),
                progress,
            )
            figures, counts = await bench.run()
        progress("stopping the servers")
    other = {phase: other_cpu(cpu) for phase, cpu in bench.other.items()}
    return StormReport(
        quick=quick,
        cores=_cores(plan),
        settings=msgspec.structs.asdict(settings),
        seconds=time.monotonic() - started,
        figures=figures,
        counts=counts,
        environment=environment((loadavg_start, os.getloadavg()[0]), other),
    )


def build_parser() -> argparse.ArgumentParser:
    parser = bench_parser(
        "bench.storm", __doc__, DEFAULT_JSON, "a smoke run of a few seconds", "where the raw figures go"
    )
    parser.add_argument(
        "--release-workers",
        type=int,
        default=None,
        help=f"the sidecar's --release-workers (default {FULL.release_workers}, the sidecar's own default)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    settings = QUICK if args.quick else FULL
    if args.release_workers is not None:
        if args.release_workers < 1:
            parser.error("--release-workers must be at least 1")
        settings = msgspec.structs.replace(settings, release_workers=args.release_workers)
    return run_and_report(
        "bench.storm", lambda plan: run(settings, plan, args.quick, _progress), render, args.json
    )


_STARTED = time.monotonic()


def _progress(line: str) -> None:
    print(f"[{time.monotonic() - _STARTED:5.1f} s] {line}", file=sys.stderr, flush=True)
