"""``python -m bench.bench_router [--quick] [--json PATH]``: the router path against the sidecar-only path.

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
out as in ``bench.procs``: P, D and this load generator on one core, both
sidecars on the other, each child in its own session, dying with us;
readiness is polled against deadlines. The whole run (start-up included) is
bounded: 40 s full, 10 s quick.

Exit codes: 0 when the run completed; 1 when the benchmark broke (a server
would not start or answered wrongly); 130 on Ctrl-C.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import aiohttp
import msgspec

from bench.cli import progress, run_and_report
from bench.load import Sample, check
from bench.procs import HOST, BenchError, Child, CorePlan, free_port, sidecar_argv, starting, wait_all_ready
from bench.settings import CountedSettings
from bench.stats import ms, percentile
from sidecar.router import decode_body, prefill_body

PathName = Literal["router", "sidecar_only"]
PATHS: tuple[PathName, PathName] = ("router", "sidecar_only")
_ORDERS: tuple[tuple[PathName, PathName], ...] = (PATHS, (PATHS[1], PATHS[0]))
VERSION = "0.33.0"
ROUTE = "/v1/completions"
MODEL = "sim-model"  # sim-decode's default served model
DEFAULT_JSON = Path("out/bench-router.json")
_JSON_HEADERS = {"content-type": "application/json"}


FULL = CountedSettings(
    requests={1: 2500, 8: 5000}, warmup=20, rounds=2, total_bound=38.0, ready_timeout=30.0,
    request_timeout=10.0, shutdown_reserve=3.0,
)  # fmt: skip
QUICK = CountedSettings(
    requests={1: 300, 8: 600}, warmup=5, rounds=1, total_bound=8.5, ready_timeout=30.0,
    request_timeout=10.0, shutdown_reserve=3.0,
)  # fmt: skip


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
        headers = {**_JSON_HEADERS, "x-request-id": f"bench-{uuid.uuid4().hex}"}
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


@dataclass(slots=True)
class Pooled:
    latencies: list[float] = field(default_factory=list)
    wall: float = 0.0

    def figures(self) -> dict[str, float]:
        if not self.latencies or self.wall <= 0:
            raise BenchError("a phase completed no request")
        return {
            "requests": len(self.latencies),
            "rps": len(self.latencies) / self.wall,
            "p50_ms": ms(percentile(self.latencies, 50)),
            "p99_ms": ms(percentile(self.latencies, 99)),
        }


async def run(settings: CountedSettings, plan: CorePlan, quick: bool) -> dict[str, Any]:
    started = time.monotonic()
    pooled = {(c, path): Pooled() for c in settings.requests for path in PATHS}
    stopped_early: list[str] = []
    with launched(plan) as (servers, ready):
        # Start-up (four processes, NIXL agents) has its own bound: a loaded machine may take
        # seconds, and the measured phases keep their whole budget after it.
        await wait_all_ready(ready, started + settings.ready_timeout)
        end = time.monotonic() + settings.total_bound - settings.shutdown_reserve
        progress(f"ready after {time.monotonic() - started:.1f} s; {_cores(plan)}")
        left = len(settings.requests) * settings.rounds * len(PATHS)
        for connections, count in settings.requests.items():
            for round_ in range(settings.rounds):
                for path in _ORDERS[round_ % 2]:
                    bound = (end - time.monotonic()) / left
                    left -= 1
                    if bound <= 0.2:
                        raise BenchError("no time left for the measured phases (start-up too slow)")
                    sample = await _measure(servers, settings, path, connections, count, bound)
                    pooled[connections, path].latencies += sample.latencies
                    pooled[connections, path].wall += sample.wall
                    if sample.bounded:
                        stopped_early.append(f"c{connections} {path} round {round_ + 1}")
                    done = len(sample.latencies)
                    progress(
                        f"c{connections:<2} round {round_ + 1} {path:<12} {done:>6} in {sample.wall:5.2f} s"
                        f"  {done / sample.wall:7.0f}/s  p50 {ms(percentile(sample.latencies, 50)):6.2f} ms"
                    )
        p_stats = await _p_stats(
            servers.prefill_url, min(end + settings.shutdown_reserve / 2, time.monotonic() + 1)
        )
    figures = {path: {f"c{c}": pooled[c, path].figures() for c in settings.requests} for path in PATHS}
    ratios = {
        f"c{c}": {
            name: figures["router"][f"c{c}"][name] / figures["sidecar_only"][f"c{c}"][name]
            for name in ("rps", "p50_ms", "p99_ms")
        }
        for c in settings.requests
    }
    added = {
        f"c{c}": {
            name: figures["router"][f"c{c}"][name] - figures["sidecar_only"][f"c{c}"][name]
            for name in ("p50_ms", "p99_ms")
        }
        for c in settings.requests
    }
    return {
        "quick": quick,
        "cores": _cores(plan),
        "seconds": time.monotonic() - started,
        "router": figures["router"],
        "sidecar_only": figures["sidecar_only"],
        "ratios": ratios,  # router / sidecar-only
        "added_ms": added,  # router - sidecar-only (may be negative: noise, or one client hop fewer)
        "prefill": p_stats,
        "stopped_early": stopped_early,
    }


async def _measure(
    servers: Servers, settings: CountedSettings, path: PathName, connections: int, count: int, bound: float
) -> Sample:
    client = Client(servers, path, connections, settings.request_timeout)
    try:
        warm = await client.run(settings.warmup * connections, min(bound / 4, 2.0))
        check(warm, servers.children, f"{path} at {connections} connection(s), warm-up")
        sample = await client.run(count, bound - warm.wall)
    finally:
        await client.close()
    check(sample, servers.children, f"{path} at {connections} connection(s), measured phase")
    return sample


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
    lines = [
        f"router mode vs sidecar-only ({'quick' if report['quick'] else 'full'} run, "
        f"{report['seconds']:.1f} s; {report['cores']})",
        f"{'':<4} {'path':<13} {'requests':>8} {'req/s':>9} {'p50 ms':>8} {'p99 ms':>8}",
    ]
    for conns in report["ratios"]:
        for path in PATHS:
            f = report[path][conns]
            row = f"{f['rps']:>9.0f} {f['p50_ms']:>8.2f} {f['p99_ms']:>8.2f}"
            lines.append(f"{conns:<4} {path:<13} {f['requests']:>8} {row}")
        r, a = report["ratios"][conns], report["added_ms"][conns]
        row = f"{r['rps']:>8.2f}x {r['p50_ms']:>7.2f}x {r['p99_ms']:>7.2f}x"
        lines.append(
            f"{conns:<4} {'router/only':<13} {'':>8} {row}"
            f"   added p50 {a['p50_ms']:+.2f} ms, p99 {a['p99_ms']:+.2f} ms"
        )
    p = report["prefill"]
    lines.append(
        f"P: {p['freed_by_notification']} freed by D's notification, {p['pinned_requests']} still pinned, "
        f"{p['notifs_unknown']} unknown notifications"
    )
    if report["stopped_early"]:
        lines.append("stopped early by the time bound: " + ", ".join(report["stopped_early"]))
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.bench_router", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run bounded to 10 s")
    parser.add_argument(
        "--json", type=Path, default=DEFAULT_JSON, help=f"raw figures (default {DEFAULT_JSON})"
    )
    args = parser.parse_args(argv)
    settings = QUICK if args.quick else FULL
    return run_and_report("bench_router", lambda plan: run(settings, plan, args.quick), render, args.json)


def _cores(plan: CorePlan) -> str:
    return plan.describe("load generator + P + D", "both sidecars")


if __name__ == "__main__":
    raise SystemExit(main())
