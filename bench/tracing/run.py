"""``python -m bench.tracing [--quick] [--json PATH]``: what OpenTelemetry tracing costs the sidecar.

One run, three paths to the same D (``sim-decode``), non-streaming chat
completions carrying ``kv_transfer_params`` (the inspected path):

* direct: the client talks to D;
* off: through a sidecar with tracing off (the default);
* on: through a sidecar with ``--otlp-traces-endpoint`` pointing at a local
  OTLP/HTTP sink (every trace sampled: the worst case), which decodes and
  counts the spans it receives.

Each path is measured at 1 and at 32 connections, ``rounds`` times, the
path order rotated every round, after its own warm-up. Reported: req/s, p50,
the sidecar's CPU seconds per 1,000 requests (``/proc``, all threads, so the
exporter's thread counts), the ratios to direct and on/off, and the spans
the sink received. A micro-measurement times the guards tracing-off leaves on
the request path (``tracing.enabled`` checks, ``exchange.leg`` tests) per
request, in process. Processes are laid out as in ``bench.harness.procs``: D, the
sink and this load generator on one core, both sidecars on the other.

Exit codes: 0 when the run completed; 1 when the benchmark broke; 130 on Ctrl-C.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import functools
import json
import sys
import time
import timeit
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import aiohttp

from bench.harness.load import LoadClient, Sample
from bench.harness.main import bench_parser, progress, run_and_report
from bench.harness.procs import HOST, Child, CorePlan, sidecar_argv, starting
from bench.harness.rounds import CountedPhase, counted_rounds, render_counted
from bench.harness.settings import CountedSettings
from tests.support.ports import free_port

PathName = Literal["direct", "off", "on"]
PATHS: tuple[PathName, ...] = ("direct", "off", "on")
DEFAULT_JSON = Path("out/bench-tracing.json")
LAYOUT = ("load generator + D + sink", "both sidecars")  # on the load core, and on the other
SPANS_PER_REQUEST = 2  # kvr.proxy and kvr.decode (D answers 200: no release)


FULL = CountedSettings(
    requests={1: 2000, 32: 8000}, warmup=20, rounds=2, total_bound=75.0,
    request_timeout=30.0, shutdown_reserve=1.5,
)  # fmt: skip
QUICK = dataclasses.replace(FULL, requests={1: 200, 32: 600}, warmup=5, rounds=1, total_bound=14.0)


@dataclass(frozen=True, slots=True)
class Servers:
    urls: dict[PathName, str]
    sink_url: str
    sidecars: dict[PathName, Child]
    children: tuple[Child, ...]


@contextlib.contextmanager
def launched(plan: CorePlan) -> Iterator[tuple[Servers, dict[Child, str]]]:
    """Start D, the sink and both sidecars (not yet known ready); stop them all on exit."""
    d, sink, off, off_admin, on, on_admin = (free_port() for _ in range(6))
    d_url, sink_url = f"http://{HOST}:{d}", f"http://{HOST}:{sink}"
    common = ["serve", "--host", HOST, "--admin-host", HOST, "--decode-url", d_url, "--log-level", "error"]
    common += ["--release", "dry-run", "--drain-timeout", "1", "--flush-timeout", "1"]
    specs: list[tuple[str, list[str], frozenset[int], str]] = [
        ("sim-decode", sidecar_argv("sim-decode", "--host", HOST, "--port", str(d)), plan.load,
         d_url + "/health"),
        ("otlp-sink", [sys.executable, "-m", "bench.tracing", "--sink", str(sink)], plan.load,
         sink_url + "/stats"),
        ("sidecar-off", sidecar_argv(*common, "--port", str(off), "--admin-port", str(off_admin)),
         plan.sidecar, f"http://{HOST}:{off_admin}/readyz"),
        ("sidecar-on", sidecar_argv(*common, "--port", str(on), "--admin-port", str(on_admin),
                                    "--otlp-traces-endpoint", sink_url),
         plan.sidecar, f"http://{HOST}:{on_admin}/readyz"),
    ]  # fmt: skip
    with starting("kvr-bench-tracing-") as (_, start):
        ready = {start(name, argv, cpus): url for name, argv, cpus, url in specs}
        children = tuple(ready)
        urls: dict[PathName, str] = {
            "direct": d_url,
            "off": f"http://{HOST}:{off}",
            "on": f"http://{HOST}:{on}",
        }
        yield Servers(urls, sink_url, {"off": children[2], "on": children[3]}, children), ready


async def run(settings: CountedSettings, plan: CorePlan, quick: bool) -> dict[str, Any]:
    started = time.monotonic()
    with launched(plan) as (servers, ready):

        async def measure(path: PathName, phase: CountedPhase) -> tuple[Sample, float]:
            async with LoadClient(servers.urls[path], phase.connections, settings.request_timeout) as client:
                send = functools.partial(client.run, "json")
                return await phase.warm_then_measure(send, servers.children, path, servers.sidecars.get(path))

        counted = await counted_rounds(
            settings, PATHS, measure, progress, ready=ready, started=started, cores=plan.describe(*LAYOUT)
        )
        sent_on = counted.completed("on")
        # SIGTERM: the sidecar's shutdown flushes what its batch processor still holds.
        await asyncio.to_thread(servers.sidecars["on"].stop)
        sink = await _sink_stats(servers, time.monotonic() + 1.0, sent_on * SPANS_PER_REQUEST)
    figures: dict[str, dict[str, dict[str, float]]] = {
        path: counted.figures(path, p99=False) for path in PATHS
    }
    ratios: dict[str, dict[str, float]] = {}
    for c in figures["direct"]:
        f = {path: figures[path][c] for path in PATHS}
        ratios[c] = {
            "off_rps_vs_direct": f["off"]["rps"] / f["direct"]["rps"],
            "on_rps_vs_direct": f["on"]["rps"] / f["direct"]["rps"],
            "on_rps_vs_off": f["on"]["rps"] / f["off"]["rps"],
            "on_cpu_vs_off": f["on"]["cpu_s_per_1k"] / f["off"]["cpu_s_per_1k"],
        }
    hook_ns = disabled_hook_ns()
    off_cpu_ns = figures["off"]["c32"]["cpu_s_per_1k"] * 1e6  # ns of sidecar CPU per request
    return {
        "quick": quick,
        "cores": plan.describe(*LAYOUT),
        "seconds": time.monotonic() - started,
        **figures,
        "ratios": ratios,
        "sink": {**sink, "requests_traced": sent_on, "expected_spans_at_least": sent_on * SPANS_PER_REQUEST},
        "disabled_hooks": {"ns_per_request": hook_ns, "share_of_off_cpu": hook_ns / off_cpu_ns},
        "stopped_early": counted.stopped_early,
    }


async def _sink_stats(servers: Servers, deadline: float, expected: int) -> dict[str, int]:
    """The sink's counts once every span arrived (polled until ``deadline``, then as they are)."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1.0)) as session:
        while True:
            async with session.get(servers.sink_url + "/stats") as response:
                stats: dict[str, int] = json.loads(await response.read())
            if stats["spans"] >= expected or time.monotonic() > deadline:
                return stats
            await asyncio.sleep(0.02)  # poll interval


def disabled_hook_ns(loops: int = 200_000) -> float:
    """ns per request of the guards tracing-off leaves on a sidecar-mode request, measured in process.

    A sidecar-mode request passes ``Proxy.__call__`` (``route is not None and
    tracing.enabled``), ``Forwarder.forward`` (``tracing.enabled``), ``_respond``
    and the end of ``forward`` (``leg is not None``, a local, twice) and
    ``Judge.judge`` (``tracing.enabled``, once): the same guards, against the
    same objects, timed against the same function without them.
    """
    from sidecar.observability.tracing import OFF, Leg

    class Holder:
        tracing = OFF

    proxy, route = Holder(), "/x"
    leg: Leg | None = None

    def guarded() -> int:
        n = 0
        if route is not None and proxy.tracing.enabled:
            n += 1
        if proxy.tracing.enabled:
            n += 1
        if leg is not None:
            n += 1
        if leg is not None:
            n += 1
        if proxy.tracing.enabled:
            n += 1
        return n

    def bare() -> int:
        return 0

    best = min(timeit.repeat(guarded, number=loops, repeat=5)) - min(
        timeit.repeat(bare, number=loops, repeat=5)
    )
    return max(best, 0.0) / loops * 1e9


def render(report: dict[str, Any]) -> str:
    def summary(conns: str) -> str:
        r = report["ratios"][conns]
        return (
            f"{conns:<4} req/s off/direct {r['off_rps_vs_direct']:.2f}x, "
            f"on/direct {r['on_rps_vs_direct']:.2f}x, on/off {r['on_rps_vs_off']:.2f}x; "
            f"CPU per request on/off {r['on_cpu_vs_off']:.2f}x"
        )

    s, h = report["sink"], report["disabled_hooks"]
    tail = [
        f"sink: {s['spans']} spans in {s['requests']} exports for {s['requests_traced']} traced requests "
        f"(expected at least {s['expected_spans_at_least']})",
        f"tracing off, guards left on the request path: {h['ns_per_request']:.0f} ns per request "
        f"({h['share_of_off_cpu'] * 100:.3f}% of the off sidecar's CPU per request at c32)",
    ]
    cpu = (f"{'CPU s/1k':>9}", lambda f: f"{f['cpu_s_per_1k']:>9.3f}" if "cpu_s_per_1k" in f else f"{'-':>9}")
    return render_counted(report, "tracing cost", PATHS, cpu, summary, tail)


# --- the OTLP/HTTP sink (a child process) ------------------------------------------------------


def sink(port: int) -> int:
    """Accept ``POST /v1/traces`` (protobuf), count requests and spans; ``GET /stats`` reports them."""
    import uvicorn
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    counts = {"requests": 0, "spans": 0, "bytes": 0}

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        answer, status = b"", 404
        if scope["method"] == "POST" and scope["path"] == "/v1/traces":
            request = ExportTraceServiceRequest()
            request.ParseFromString(body)
            counts["requests"] += 1
            counts["bytes"] += len(body)
            counts["spans"] += sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)
            answer, status = ExportTraceServiceRequest().SerializeToString(), 200
        elif scope["path"] == "/stats":
            answer, status = json.dumps(counts).encode(), 200
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [(b"content-length", b"%d" % len(answer))],
            }
        )
        await send({"type": "http.response.body", "body": answer})

    uvicorn.run(app, host=HOST, port=port, log_level="error", lifespan="off", http="httptools", loop="uvloop")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = bench_parser(
        "bench.tracing", __doc__, DEFAULT_JSON, "a smoke run bounded to 15 s", "raw figures"
    )
    parser.add_argument("--sink", type=int, metavar="PORT", help=argparse.SUPPRESS)  # the child process
    args = parser.parse_args(argv)
    if args.sink is not None:
        return sink(args.sink)
    settings = QUICK if args.quick else FULL
    return run_and_report("bench.tracing", lambda plan: run(settings, plan, args.quick), render, args.json)
