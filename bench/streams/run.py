"""``python -m bench --workload streams``: thousands of concurrent SSE streams through each hop, in one run.

Every client (2,000 by default) holds a keep-alive connection and runs a
closed loop of streaming chat completions, each 64 events spread over 2 s by
the fake D: 64,000 events/s at 2,000 clients. The clients connect evenly over
a ramp; the streams started after it are measured. Two modes:

* **sidecar**: the client sends each request with ``kv_transfer_params`` of
  its own (so the sidecar inspects it and judges the stream's first event)
  to D directly, or through the sidecar (``serve --release dry-run``), the
  byte relay (``bench.servers.relay``) or nginx;
* **router**: each stream is two legs, a prefill leg on P (``bench.servers.fakes
  --role prefill``) and the stream on D with P's parameters. Direct, the
  relay and nginx carry the client's two legs (the client runs them); the
  sidecar in router mode (``--prefill``) gets one request and runs both.
  Time to first token counts from the prefill leg. Named in ``--paths``,
  vLLM's own P/D router (``vllm-router``, ``bench.streams.vllm_router``) is a hop
  of this mode too, pinned and on both CPUs, read beside the sidecar
  (``bench.streams.versus``).

Core layout as in ``python -m bench``: the hops on the second CPU, one
measured at a time; the load generator and fake D (``bench/streams/streams.c``, in C:
``bench.streams.cstreams``) and the fake P on the first. After each path's phase a
smaller one (300 clients) runs on the same path at once: how fast its tail
recovers. Then, in sidecar mode, the accept-burst step: the same clients streaming again and,
a second into the window, ``burst`` new clients (500) connecting at once, each with one stream;
their time to first token includes the wait in the hop's accept queue. Every round measures
every path of both modes, the order rotating;
each round is reported on its own. The load average and the busiest other
processes are read at the start and the end, and the other processes' CPU on
each core during every phase.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import msgspec

from bench.harness import profile
from bench.harness.load import request_body
from bench.harness.noise import Other, busiest, loadavg, process_cpu, snapshot_of, wait_quiet
from bench.harness.procs import (
    HOST,
    Child,
    CorePlan,
    peaks,
    serve_args,
    sidecar_argv,
    starting,
    wait_all_ready,
)
from bench.harness.report import MB
from bench.harness.rounds import order
from bench.servers.nginx import nginx_config
from bench.streams import cstreams, vllm_router
from bench.streams.render import render
from bench.streams.report import HopLoad, Machine, Mode, PathRun, RoundMode, StreamsReport, added, targets
from bench.streams.versus import versus
from sidecar.router.bodies import PREFILL_PARAMS
from tests.support.ports import free_port

__all__ = ["StreamsReport", "StreamsSettings", "render", "run", "settings"]


# In their base order; "baseline" is the sidecar of another checkout (``--baseline``), "limited"
# the sidecar with ``--limit-concurrency`` (``--limit``, sidecar mode).
# "sidecar-w2" and "nginx-w2" (``--workers 1,2``): the sidecar with ``--workers 2`` and nginx with
# ``worker_processes 2``, each free to run on both CPUs (the load side's one included).
# "vllm-router" and "vllm-router-w2" (router mode, only when named in ``--paths``): vLLM's own P/D
# router (``bench.streams.vllm_router``) pinned to the hop's CPU, and free on both CPUs with its default
# threads (one per CPU it may use).
PATHS = (
    "direct", "sidecar", "sidecar-w2", "limited", "baseline", "relay", "nginx", "nginx-w2",
    "vllm-router", "vllm-router-w2",
)  # fmt: skip
VLLM_ROUTER_PATHS = ("vllm-router", "vllm-router-w2")
# Where one request goes and the hop runs both legs (router mode).
ONE_REQUEST = ("sidecar", "sidecar-w2", "baseline", *VLLM_ROUTER_PATHS)


class StreamsSettings(msgspec.Struct, frozen=True, kw_only=True):
    clients: int = 2000
    events: int = 64
    duration: float = 2.0  # seconds from a stream's first event to its last
    seconds: float = 10.0  # the measured window of each phase
    ramp: float = 2.0
    rounds: int = 2
    recovery_clients: int = 300
    recovery_seconds: float = 4.0
    modes: tuple[Mode, ...] = ("sidecar", "router")
    # Which of them to measure (direct always; vllm-router's only when named).
    paths: tuple[str, ...] = tuple(p for p in PATHS if p not in VLLM_ROUTER_PATHS)
    ready_timeout: float = 30.0
    # Another checkout of the project (a directory): its sidecar is measured too, as "baseline".
    baseline: str = ""
    # Sample the sidecars with py-spy during their main phases (bench.harness.profile), into this directory.
    profile: str = ""
    # Before each path, wait until other processes use at most ``quiet`` cores' worth of the two
    # cores (over a second), for at most ``quiet_wait`` seconds; what was waited is reported.
    quiet: float = 0.25
    quiet_wait: float = 180.0
    # Above 0: also a sidecar with --limit-concurrency at this many requests (sidecar mode), which
    # answers the rest 503 before admission; its clients come back a second later.
    limit: int = 0
    # The accept-burst step (sidecar mode): this many new connections at once, ``burst_at`` seconds
    # into a window of the clients' streams (0: no such step).
    burst: int = 500
    burst_at: float = 1.0
    # The workers axis: 2 adds the sidecar with --workers 2 and nginx with worker_processes 2.
    workers: int = 1
    # The vllm-router launcher (``--vllm-router``), for the vllm-router paths.
    vllm_router: str = str(vllm_router.INSTALLED)


FULL = StreamsSettings()
QUICK = StreamsSettings(
    clients=50, events=8, duration=0.3, seconds=1.0, ramp=0.2, rounds=1, recovery_clients=10,
    recovery_seconds=0.5, quiet_wait=0.0, burst=20, burst_at=0.2,
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class Hop:
    """One path's entry point(s) and the processes between the client and the servers."""

    port: int  # where the stream (or the only) request goes
    prefill_port: int  # 0: one leg
    children: tuple[Child, ...]  # the hop's processes (none on the direct path)


@dataclass(frozen=True, slots=True)
class StreamServers:
    decode: Child
    prefill: Child
    hops: dict[tuple[Mode, str], Hop]
    prefill_stats: str  # the fake P's counters (``GET /stats``)

    def load_children(self) -> tuple[Child, ...]:
        return (self.decode, self.prefill)

    def hop_children(self) -> list[Child]:
        return list(dict.fromkeys(c for hop in self.hops.values() for c in hop.children))


def _sidecar(
    name: str, decode: str, port: int, admin: int, *extra: str, checkout: Path | None = None
) -> tuple[str, list[str], str]:
    """``serve`` on ``port``; from ``checkout`` (another revision's tree) when given."""
    argv = sidecar_argv(*serve_args(decode, port, admin), *extra, checkout=checkout)
    return name, argv, f"http://{HOST}:{admin}/readyz"


def _relay(name: str, port: int, target: int) -> tuple[str, list[str], str]:
    argv = [sys.executable, "-m", "bench.servers.relay", "--host", HOST, "--port", str(port),
            "--target", f"{HOST}:{target}"]  # fmt: skip
    return name, argv, f"http://{HOST}:{port}/health"


@contextlib.contextmanager
def launched(
    plan: CorePlan, settings: StreamsSettings, binary: Path, nginx: str | None
) -> Iterator[tuple[StreamServers, dict[Child, str]]]:
    """Start D, P and every hop (not yet known ready); stop them all on exit."""
    d, p, sc, sca, rt, rta, rd, rp, nd, np_ = (free_port() for _ in range(10))
    d_url, p_url = f"http://{HOST}:{d}", f"http://{HOST}:{p}"
    fake_d = cstreams.server_argv(binary, d, settings.events, settings.duration)
    fake_p = [sys.executable, "-m", "bench.servers.fakes", "--role", "prefill", "--port", str(p)]
    load = [("fake-decode", fake_d, d_url + "/health"), ("fake-prefill", fake_p, p_url + "/health")]
    router = ("--prefill", p_url, "--prefill-allow", HOST)
    hop = [
        _sidecar("sidecar", d_url, sc, sca),
        _sidecar("sidecar-router", d_url, rt, rta, *router),
        _relay("relay-decode", rd, d),
        _relay("relay-prefill", rp, p),
    ]
    base, base_router, limited = free_port(), free_port(), free_port()
    if settings.limit:
        hop.append(
            _sidecar("limited", d_url, limited, free_port(), "--limit-concurrency", str(settings.limit))
        )
    if settings.baseline:
        checkout = Path(settings.baseline)
        hop.append(_sidecar("baseline", d_url, base, free_port(), checkout=checkout))
        hop.append(_sidecar("baseline-router", d_url, base_router, free_port(), *router, checkout=checkout))
    wide, many = [], ("--workers", str(settings.workers))
    sw, swr, nwd, nwp = (free_port() for _ in range(4))
    if settings.workers > 1:
        wide = [
            _sidecar("sidecar-w2", d_url, sw, free_port(), *many),
            _sidecar("sidecar-w2-router", d_url, swr, free_port(), *router, *many),
        ]
    with starting("kvr-bench-streams-") as (log_dir, start):
        ready: dict[Child, str] = {}
        started: dict[str, Child] = {}
        both = plan.load | plan.sidecar
        for specs, cpus in ((load, plan.load), (hop, plan.sidecar), (wide, both)):
            for name, argv, url in specs:
                child = start(name, argv, cpus)
                ready[child], started[name] = url, child
        nginxes = [("nginx", log_dir, nd, np_, 1, plan.sidecar)]
        if settings.workers > 1:
            nginxes.append(("nginx-w2", log_dir / "w2", nwd, nwp, settings.workers, both))
        for name, directory, port_d, port_p, processes, cpus in nginxes if nginx is not None else []:
            assert nginx is not None
            directory.mkdir(exist_ok=True)
            listeners = {port_d: f"{HOST}:{d}", port_p: f"{HOST}:{p}"}
            conns = 4 * settings.clients + 256  # each stream: the client's and D's (router: and P's)
            conf = nginx_config(
                nginx, directory, listeners, connections=conns, keepalive=settings.clients, workers=processes
            )
            child = start(name, [nginx, "-p", f"{directory}/", "-c", str(conf)], cpus)
            ready[child], started[name] = f"http://{HOST}:{port_d}/health", child
        relays = (started["relay-decode"], started["relay-prefill"])
        hops: dict[tuple[Mode, str], Hop] = {
            ("sidecar", "direct"): Hop(d, 0, ()),
            ("sidecar", "sidecar"): Hop(sc, 0, (started["sidecar"],)),
            ("sidecar", "relay"): Hop(rd, 0, relays[:1]),
            ("router", "direct"): Hop(d, p, ()),
            ("router", "sidecar"): Hop(rt, 0, (started["sidecar-router"],)),
            ("router", "relay"): Hop(rd, rp, relays),
        }
        if settings.limit:
            hops["sidecar", "limited"] = Hop(limited, 0, (started["limited"],))
        if settings.baseline:
            hops["sidecar", "baseline"] = Hop(base, 0, (started["baseline"],))
            hops["router", "baseline"] = Hop(base_router, 0, (started["baseline-router"],))
        if "nginx" in started:
            hops["sidecar", "nginx"] = Hop(nd, 0, (started["nginx"],))
            hops["router", "nginx"] = Hop(nd, np_, (started["nginx"],))
        if "sidecar-w2" in started:
            hops["sidecar", "sidecar-w2"] = Hop(sw, 0, (started["sidecar-w2"],))
            hops["router", "sidecar-w2"] = Hop(swr, 0, (started["sidecar-w2-router"],))
        if "nginx-w2" in started:
            hops["sidecar", "nginx-w2"] = Hop(nwd, 0, (started["nginx-w2"],))
            hops["router", "nginx-w2"] = Hop(nwd, nwp, (started["nginx-w2"],))
        for name, cpus in (("vllm-router", plan.sidecar), ("vllm-router-w2", both)):
            if name in settings.paths and "router" in settings.modes:
                port = free_port()
                child = start(name, vllm_router.argv(settings.vllm_router, p_url, d_url, port), cpus)
                ready[child] = f"http://{HOST}:{port}/health"
                hops["router", name] = Hop(port, 0, (child,))
        servers = StreamServers(started["fake-decode"], started["fake-prefill"], hops, p_url + "/stats")
        yield servers, ready


def bodies(mode: Mode, path: str, events: int) -> tuple[bytes, bytes]:
    """The stream request and (two legs) the prefill leg's, as the C client fills them in."""
    if mode == "sidecar":  # parameters of its own per request: the sidecar inspects and judges it
        return request_body(True, events).replace(b'"bench-request"', b'"@ID@"'), b""
    plain = msgspec.json.decode(request_body(True, events))
    del plain["kv_transfer_params"]
    if path in ONE_REQUEST:  # the router runs both legs
        return msgspec.json.encode(plain), b""
    stream = msgspec.json.encode({**plain, "kv_transfer_params": "@PARAMS@"}).replace(
        b'"@PARAMS@"', b"@PARAMS@"
    )
    # The prefill leg a router sends (bench.servers.fakes refuses anything else)
    prefill = msgspec.json.encode(
        {**plain, "stream": False, "max_tokens": 1, "kv_transfer_params": PREFILL_PARAMS}
    )
    return stream, prefill


def _open_files(child: Child) -> int:
    """Open file descriptors of ``child`` and its children (nginx's worker)."""
    total = 0
    for proc in (child.pid, *_children(child.pid)):
        with contextlib.suppress(OSError):
            total += len(os.listdir(f"/proc/{proc}/fd"))
    return total


def _children(pid: int) -> list[int]:
    found: list[int] = []
    for children in Path(f"/proc/{pid}/task").glob("*/children"):
        with contextlib.suppress(OSError):
            found += [int(kid) for kid in children.read_text().split()]
    return found


class Measurer:
    """Runs client phases on one path, with the CPU, memory and noise readings around them."""

    def __init__(
        self, settings: StreamsSettings, plan: CorePlan, servers: StreamServers, binary: Path
    ) -> None:
        self.settings, self._plan, self._servers, self._binary = settings, plan, servers, binary

    async def path(self, mode: Mode, path: str, round_: int) -> PathRun:
        settings, hop = self.settings, self._servers.hops[mode, path]
        children = [*self._servers.load_children(), *self._servers.hop_children()]
        waited = (0.0, 0.0)
        if settings.quiet_wait > 0:
            own = lambda: time.process_time() + _cpu(children)  # noqa: E731
            waited = await wait_quiet(self._plan, own, settings.quiet, settings.quiet_wait)
        sampled = None
        if settings.profile and path in ("sidecar", "sidecar-w2", "limited", "baseline"):
            out = Path(settings.profile) / f"profile-{mode}-{path}-round{round_}.txt"
            out.parent.mkdir(parents=True, exist_ok=True)
            seconds = settings.ramp + settings.seconds
            sampled = (out, await profile.record(hop.children[0].pid, seconds, out, self._plan.load))
        before = await _counts(self._servers.prefill_stats) if mode == "router" else {}
        main = await self.phase(mode, path, hop, settings.clients, settings.seconds, settings.ramp)
        if mode == "router":
            got = await _counts(self._servers.prefill_stats)
            main.prefill = {name: got[name] - before.get(name, 0) for name in got}
        if sampled is not None:
            await sampled[1].wait()
            main.profile = profile.summary(sampled[0])
        after = await self.phase(
            mode, path, hop, settings.recovery_clients, settings.recovery_seconds, min(0.5, settings.ramp)
        )
        main.load.waited_s, main.load.others_before = waited
        burst = await self.burst(mode, path, hop) if settings.burst and mode == "sidecar" else None
        return PathRun(
            sample=main.sample, load=main.load, recovery=after.sample, profile=main.profile, burst=burst,
            prefill=main.prefill,
        )  # fmt: skip

    async def burst(self, mode: Mode, path: str, hop: Hop) -> cstreams.StreamsSample:
        """The accept-burst step: ``clients`` streaming, and ``burst`` new clients connecting at once
        ``burst_at`` seconds into their window, one stream each; the new clients' figures."""
        settings = self.settings
        body, prefill = bodies(mode, path, settings.events)

        def phase(clients: int, seconds: float, ramp: float) -> cstreams.Phase:
            return cstreams.Phase(
                port=hop.port, clients=clients, seconds=seconds, ramp=ramp, events=settings.events,
                body=body, prefill_port=hop.prefill_port, prefill_body=prefill, drain=settings.duration + 10,
            )  # fmt: skip

        running = phase(settings.clients, settings.burst_at + settings.duration + 1.0, settings.ramp)
        # A window shorter than one stream: each new client runs one, started as its connect completes.
        arriving = phase(settings.burst, settings.duration / 2, 0.0)

        async def later() -> cstreams.StreamsSample:
            await asyncio.sleep(settings.ramp + settings.burst_at)
            return await cstreams.run_client(self._binary, self._plan.load, arriving)

        _, new = await asyncio.gather(cstreams.run_client(self._binary, self._plan.load, running), later())
        return new

    async def phase(
        self, mode: Mode, path: str, hop: Hop, clients: int, seconds: float, ramp: float
    ) -> PathRun:
        settings = self.settings
        body, prefill = bodies(mode, path, settings.events)
        phase = cstreams.Phase(
            port=hop.port, clients=clients, seconds=seconds, ramp=ramp, events=settings.events, body=body,
            prefill_port=hop.prefill_port, prefill_body=prefill, drain=settings.duration + 10,
        )  # fmt: skip
        load, hops = self._servers.load_children(), hop.children
        cpu_load, cpu_hop = _cpu(load), _cpu(hops)
        before = snapshot_of(self._plan, time.process_time() + cpu_load, _cpu(self._servers.hop_children()))
        async with peaks(hops, Child.rss_bytes, _open_files) as peak:
            sample = await cstreams.run_client(self._binary, self._plan.load, phase)
        cpu_load, cpu_hop = _cpu(load) - cpu_load, _cpu(hops) - cpu_hop
        after = snapshot_of(
            self._plan,
            time.process_time() + _cpu(load) + sample.client_cpu,
            _cpu(self._servers.hop_children()),
        )
        other = Other()
        other.add(before, after)
        other_load, other_hop = other.shares()
        wall = sample.client_wall
        return PathRun(
            sample=sample,
            load=HopLoad(
                hop_cores=cpu_hop / wall,
                hop_us_per_event=cpu_hop / max(1, sample.events_total) * 1e6,
                # every stream of the phase (ramp and drain included) had events + [DONE]
                hop_us_per_stream=cpu_hop / max(1.0, sample.events_total / (settings.events + 1)) * 1e6,
                hop_rss_peak_mb=peak[0] / MB,
                hop_fds_peak=peak[1],
                client_cores=sample.client_cpu / wall,
                decode_cores=cpu_load / wall,
                other_load_core=other_load,
                other_hop_core=other_hop,
            ),
        )


async def _counts(url: str) -> dict[str, int]:
    """The fake P's counters (``bench.servers.fakes``)."""
    timeout = aiohttp.ClientTimeout(total=10.0)
    async with aiohttp.ClientSession(timeout=timeout) as session, session.get(url) as response:
        return msgspec.json.decode(await response.read(), type=dict[str, int])


def _cpu(children: Sequence[Child]) -> float:
    return sum(child.cpu_seconds() for child in children)


async def _busiest(exclude: set[int]) -> list[tuple[str, float]]:
    before = process_cpu()
    await asyncio.sleep(1.0)  # the span the reading covers
    return busiest(before, process_cpu(), 1.0, exclude)


async def run(
    settings: StreamsSettings, plan: CorePlan, nginx: str | None, progress: Callable[[str], None], quick: bool
) -> StreamsReport:
    started = time.monotonic()
    binary = cstreams.build()
    ours = {os.getpid()}
    machine_start = (loadavg(), await _busiest(ours))
    runs: list[RoundMode] = []
    with launched(plan, settings, binary, nginx) as (servers, ready):
        await wait_all_ready(ready, started + settings.ready_timeout)
        children = {c.pid for c in ready} | {k for c in ready for k in _children(c.pid)}
        progress(f"ready: {', '.join(f'{c.name} pid {c.pid}' for c in ready)}")
        measurer = Measurer(settings, plan, servers, binary)
        for round_ in range(settings.rounds):
            for mode in settings.modes:
                paths = [p for p in PATHS if (mode, p) in servers.hops and p in ("direct", *settings.paths)]
                runs.append(await _round(measurer, mode, order(paths, round_), round_ + 1, progress))
        machine_end = (loadavg(), await _busiest(ours | children))
    skipped = [] if nginx else ["nginx: no nginx binary on PATH (--nginx PATH to give one)"]
    return StreamsReport(
        quick=quick,
        cores=plan.describe(),
        settings=msgspec.structs.asdict(settings),
        seconds=time.monotonic() - started,
        machine=Machine(
            loadavg_start=machine_start[0],
            loadavg_end=machine_end[0],
            busiest_start=machine_start[1],
            busiest_end=machine_end[1],
        ),
        runs=runs,
        skipped=skipped,
    )


async def _round(
    measurer: Measurer, mode: Mode, paths: list[str], round_: int, progress: Callable[[str], None]
) -> RoundMode:
    runs: dict[str, PathRun] = {}
    for path in paths:
        runs[path] = result = await measurer.path(mode, path, round_)
        s = result.sample
        progress(
            f"round {round_} {mode:<7} {path:<7} {s.streams:>6} streams, {s.errors} errors, TTFT p50 "
            f"{s.ttft_p50_ms:.1f} p99 {s.ttft_p99_ms:.1f} ms, gap p99 {s.gap_p99_ms:.1f} ms, hop "
            f"{result.load.hop_cores:.2f} cores, client {result.load.client_cores:.2f}, D+P "
            f"{result.load.decode_cores:.2f}, others {result.load.other_load_core:.2f}/"
            f"{result.load.other_hop_core:.2f}" + (f"; first errors: {s.first_errors}" if s.errors else "")
        )
        if (b := result.burst) is not None:
            progress(
                f"round {round_} {mode:<7} {path:<7} burst of {b.clients} new connections: {b.streams} "
                f"streams, {b.errors} errors, TTFT p50 {b.ttft_p50_ms:.1f} p99 {b.ttft_p99_ms:.1f} "
                f"max {b.ttft_max_ms:.1f} ms"
            )
    direct = runs["direct"].sample
    if not direct.streams:  # the machine stalled the direct path: nothing to add to (shown as is)
        progress(f"round {round_}, {mode} mode: no stream completed on the direct path")
        return RoundMode(round=round_, mode=mode, order=paths, paths=runs, added={}, targets=[])
    adds = {path: added(direct, run.sample) for path, run in runs.items() if path != "direct"}
    return RoundMode(
        round=round_, mode=mode, order=paths, paths=runs, added=adds, targets=targets(mode, runs, adds),
        versus=versus(runs, measurer.settings.seconds),
    )  # fmt: skip


def settings(args: argparse.Namespace) -> StreamsSettings:
    """The preset (full, or quick with ``--quick``) with the command line's overrides."""
    base = QUICK if args.quick else FULL
    given = {
        "clients": args.clients,
        "rounds": args.rounds,
        "seconds": args.seconds,
        "baseline": args.baseline,
        "profile": args.profile,
        "limit": args.limit,
        "burst": args.burst,
        "workers": max(int(n) for n in args.workers.split(",")) if args.workers else None,
        "quiet_wait": args.quiet_wait,
        "modes": tuple(args.modes.split(",")) if args.modes else None,
        "paths": tuple(args.paths.split(",")) if args.paths else None,
        "vllm_router": args.vllm_router,
    }
    return msgspec.structs.replace(base, **{k: v for k, v in given.items() if v is not None})
