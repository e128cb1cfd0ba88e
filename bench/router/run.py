"""``python -m bench.router [--quick] [--json PATH]``: the router path against the sidecar-only path.

Both paths run the same two legs on the same P (``sim-prefill``, vLLM 0.33.0,
TP 1, a pool too big to fill, no lease) and the same D (``sim-decode
--vllm-d``, which frees P's blocks over NIXL):

* router: the client sends one request to a sidecar in router mode
  (``--prefill <P>``), which runs the prefill leg on P and the decode leg on D;
* sidecar-only: the client runs the prefill leg on P itself (the body the
  router would send), then sends the decode request with P's
  ``kv_transfer_params`` through a plain sidecar (``--release nixl``) to D.

So the difference is where the prefill leg is orchestrated: the router's
added latency and its requests/s are measured against a client doing the
same two hops itself. Each path is measured at 1 and at 8 connections,
``rounds`` times in ABBA order, after its own warm-up. The processes are laid
out as in ``bench.harness.procs``: P, D and this load generator on one core, both
sidecars on the other, each child in its own session, dying with us;
readiness is polled against deadlines. The whole run (start-up included) is
bounded: 40 s full, 10 s quick.

Exit codes: 0 when the run completed; 1 when the benchmark broke (a server
would not start or answered wrongly); 130 on Ctrl-C.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import aiohttp
import msgspec

from bench.harness.load import HEADERS, Sample
from bench.harness.main import bench_parser, progress, run_and_report
from bench.harness.procs import HOST, Child, CorePlan, sidecar_argv, starting
from bench.harness.rounds import CountedPhase, counted_rounds, render_counted
from bench.harness.settings import CountedSettings
from sidecar.router import decode_body, prefill_body
from tests.support.ports import free_port

PathName = Literal["router", "sidecar_only"]
PATHS: tuple[PathName, PathName] = ("router", "sidecar_only")
VERSION = "0.34.0"
ROUTE = "/v1/completions"
MODEL = "sim-model"  # sim-decode's default served model
DEFAULT_JSON = Path("out/bench-router.json")
LAYOUT = ("load generator + P + D", "both sidecars")  # on the load core, and on the other


FULL = CountedSettings(
    requests={1: 2500, 8: 5000}, warmup=20, rounds=2, total_bound=38.0,
    request_timeout=10.0, shutdown_reserve=3.0,
)  # fmt: skip
QUICK = dataclasses.replace(FULL, requests={1: 300, 8: 600}, warmup=5, rounds=1, total_bound=8.5)


def request(index: int) -> dict[str, Any]:
    return {"model": MODEL, "prompt": f"benchmark prompt number {index} tok tok tok", "max_tokens": 4}


@dataclass(frozen=True, slots=True)
class Servers:
    prefill_url: str
    decode_url: str
    router_url: str  # sidecar in router mode
    plain_url: str  # sidecar in front of D only
    children: tuple[Child, ...]


@contextlib.contextmanager
def launched(plan: CorePlan) -> Iterator[tuple[Servers, dict[Child, str]]]:
    """Start P, D and both sidecars (not yet known ready); stop them all on exit.

    Yields the servers and, per child, the URL that answers 200 once it is ready.
    """
    p, d, r, ra, s, sa = (free_port() for _ in range(6))
    p_url, d_url = f"http://{HOST}:{p}", f"http://{HOST}:{d}"
    sidecar_common = ["--host", HOST, "--admin-host", HOST, "--log-level", "error", "--decode-url", d_url]
    sidecar_common += ["--release", "nixl", "--drain-timeout", "1", "--flush-timeout", "1"]
    specs: list[tuple[str, list[str], frozenset[int], str]] = [
        (
            "sim-prefill",
            ["sim-prefill", "--host", HOST, "--port", str(p), "--vllm-version", VERSION, "--tp", "1",
             "--num-blocks", "200000", "--lease", "0", "--side-channel-port", "0", "--log-level", "error"],
            plan.load,
            p_url + "/health",
        ),
        (
            "sim-decode",
            ["sim-decode", "--host", HOST, "--port", str(d), "--vllm-d", "--version", VERSION],
            plan.load,
            d_url + "/health",
        ),
        (
            "sidecar-router",
            ["serve", *sidecar_common, "--port", str(r), "--admin-port", str(ra), "--prefill", p_url,
             "--prefill-allow", HOST, "--vllm-version", VERSION],
            plan.sidecar,
            f"http://{HOST}:{ra}/readyz",
        ),
        (
            "sidecar-plain",
            ["serve", *sidecar_common, "--port", str(s), "--admin-port", str(sa)],
            plan.sidecar,
            f"http://{HOST}:{sa}/readyz",
        ),
    ]  # fmt: skip
    with starting("kvr-bench-router-") as (_, start):
        ready = {start(name, sidecar_argv(*args), cpus): url for name, args, cpus, url in specs}
        servers = Servers(p_url, d_url, f"http://{HOST}:{r}", f"http://{HOST}:{s}", tuple(ready))
        yield servers, ready


class Client:
    """``connections`` closed-loop workers over one pooled session, for one path."""

    def __init__(self, servers: Servers, path: PathName, connections: int, timeout: float) -> None:
        self.servers, self.path, self.connections = servers, path, connections
        # the sidecar-only path talks to two servers: a pool of ``connections`` per host
        connector = aiohttp.TCPConnector(limit=0, limit_per_host=connections)
        self.session = aiohttp.ClientSession(
            connector=connector,
            timeout=aiohttp.ClientTimeout(total=timeout),
            skip_auto_headers=["User-Agent"],
        )
        self._counter = 0

    async def close(self) -> None:
        await self.session.close()

    async def run(self, count: int, bound: float) -> Sample:
        sample = Sample()
        left = [count]
        start = time.monotonic()
        end = start + bound

        async def worker() -> None:
            while left[0] > 0:
                if time.monotonic() > end:
                    sample.bounded = True
                    return
                left[0] -= 1
                began = time.perf_counter()
                problem = await self._one()
                if problem:
                    sample.fail(problem)
                else:
                    sample.latencies.append(time.perf_counter() - began)

        await asyncio.gather(*(worker() for _ in range(self.connections)))
        sample.wall = time.monotonic() - start
        return sample

    async def _one(self) -> str | None:
        """One request on this path; an error description, or None when it was answered right."""
        self._counter += 1
        body = request(self._counter)
        headers = {**HEADERS, "x-request-id": f"bench-{uuid.uuid4().hex}"}
        try:
            if self.path == "router":
                return await self._post(self.servers.router_url, msgspec.json.encode(body), headers)
            p_body = prefill_body(body, ROUTE)  # exactly what the router sends P
            async with self.session.post(self.servers.prefill_url + ROUTE, data=p_body, headers=headers) as r:
                answer = await r.read()
                if r.status != 200:
                    return f"prefill leg: {r.status} {answer[:200]!r}"
            params = msgspec.json.decode(answer).get("kv_transfer_params")
            if not isinstance(params, dict):
                return f"prefill leg: no kv_transfer_params in {answer[:200]!r}"
            return await self._post(self.servers.plain_url, decode_body(body, params), headers)
        except (aiohttp.ClientError, TimeoutError, msgspec.DecodeError) as exc:
            return f"{type(exc).__name__}: {exc}"

    async def _post(self, url: str, data: bytes, headers: dict[str, str]) -> str | None:
        async with self.session.post(url + ROUTE, data=data, headers=headers) as r:
            answer = await r.read()
            if r.status != 200:
                return f"{url}: {r.status} {answer[:200]!r}"
        if b'"choices"' not in answer:
            return f"{url}: no choices in {answer[:200]!r}"
        return None


async def run(settings: CountedSettings, plan: CorePlan, quick: bool) -> dict[str, Any]:
    started = time.monotonic()
    with launched(plan) as (servers, ready):

        async def measure(path: PathName, phase: CountedPhase) -> tuple[Sample, float]:
            client = Client(servers, path, phase.connections, settings.request_timeout)
            try:
                return await phase.warm_then_measure(client.run, servers.children, path)
            finally:
                await client.close()

        # Start-up (four processes, NIXL agents) has its own bound: a loaded machine may take seconds.
        counted = await counted_rounds(
            settings, PATHS, measure, progress, ready=ready, started=started, cores=plan.describe(*LAYOUT)
        )
        p_stats = await _p_stats(
            servers.prefill_url, min(counted.end + settings.shutdown_reserve / 2, time.monotonic() + 1)
        )
    figures = {path: counted.figures(path) for path in PATHS}
    ratios = {
        c: {
            name: figures["router"][c][name] / figures["sidecar_only"][c][name]
            for name in ("rps", "p50_ms", "p99_ms")
        }
        for c in figures["router"]
    }
    added = {
        c: {
            name: figures["router"][c][name] - figures["sidecar_only"][c][name]
            for name in ("p50_ms", "p99_ms")
        }
        for c in figures["router"]
    }
    return {
        "quick": quick,
        "cores": plan.describe(*LAYOUT),
        "seconds": time.monotonic() - started,
        "router": figures["router"],
        "sidecar_only": figures["sidecar_only"],
        "ratios": ratios,  # router / sidecar-only
        "added_ms": added,  # router - sidecar-only (may be negative: noise, or one client hop fewer)
        "prefill": p_stats,
        "stopped_early": counted.stopped_early,
    }


async def _p_stats(url: str, deadline: float) -> dict[str, Any]:
    """P's counters once D freed every block (polled until ``deadline``, then as they are)."""
    keys = ("freed_by_notification", "pinned_requests", "notifs_unknown")
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1.0)) as session:
        while True:
            async with session.get(url + "/stats") as response:
                stats = await response.json()
            if stats.get("pinned_requests") == 0 or time.monotonic() > deadline:
                return {key: stats.get(key) for key in keys}
            await asyncio.sleep(0.02)  # poll interval


def render(report: dict[str, Any]) -> str:
    def summary(conns: str) -> str:
        r, a = report["ratios"][conns], report["added_ms"][conns]
        row = f"{r['rps']:>8.2f}x {r['p50_ms']:>7.2f}x {r['p99_ms']:>7.2f}x"
        return (
            f"{conns:<4} {'router/only':<13} {'':>8} {row}"
            f"   added p50 {a['p50_ms']:+.2f} ms, p99 {a['p99_ms']:+.2f} ms"
        )

    p = report["prefill"]
    prefill = (
        f"P: {p['freed_by_notification']} freed by D's notification, {p['pinned_requests']} still pinned, "
        f"{p['notifs_unknown']} unknown notifications"
    )
    p99 = (f"{'p99 ms':>8}", lambda f: f"{f['p99_ms']:>8.2f}")
    return render_counted(report, "router mode vs sidecar-only", PATHS, p99, summary, [prefill])


def main(argv: Sequence[str] | None = None) -> int:
    parser = bench_parser("bench.router", __doc__, DEFAULT_JSON, "a smoke run bounded to 10 s", "raw figures")
    args = parser.parse_args(argv)
    settings = QUICK if args.quick else FULL
    return run_and_report("bench.router", lambda plan: run(settings, plan, args.quick), render, args.json)
