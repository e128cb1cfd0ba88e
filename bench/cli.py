"""``python -m bench [--workload paths|streams|releases] [--quick] [--json PATH] ...``: run, print, save.

``--workload paths`` (the default) is the request-path comparison below;
``streams`` is thousands of concurrent SSE streams through each hop
(``bench.streams``); ``releases`` is the release pipeline under a steady rate
of rejected requests (``bench.releases``).

The JSON phases use wrk when a ``wrk`` binary is on ``PATH`` (or given with
``--wrk``), and fall back to the Python load generator otherwise (or with
``--no-wrk``), saying so on stderr and in the table. nginx, the optional
fourth path, is measured when an ``nginx`` binary is on ``PATH`` or given
with ``--nginx``; otherwise one progress line says it was skipped. The bench
never installs either.

Exit codes: 0 when the run completed, whatever the targets say (a MISS is a
finding, not a failure); 1 when the benchmark itself broke (a server would
not start or gave wrong answers); 2 on bad arguments; 130 on Ctrl-C.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path

from bench.harness.load import request_body
from bench.harness.main import progress, run_and_report
from bench.harness.procs import CorePlan
from bench.paths.measure import JsonLoad, PythonJson
from bench.paths.render import render
from bench.paths.report import Report
from bench.paths.run import run
from bench.paths.settings import FULL, QUICK, Settings
from bench.paths.wrk import find_wrk

DEFAULT_JSON = {
    "paths": Path("out/bench.json"),
    "streams": Path("out/bench-streams.json"),
    "releases": Path("out/bench-releases.json"),
}


# The streams and releases workloads' own flags (their ``run.settings`` reads them).
WORKLOAD_OPTIONS: list[tuple[str, dict[str, object]]] = [
    ("--clients", {"type": int, "help": "streams: concurrent clients (default 2000)"}),
    ("--rounds", {"type": int, "help": "streams: rounds of every path (default 2)"}),
    (
        "--baseline",
        {"metavar": "DIR", "help": "also the sidecar of another checkout (a worktree), as path baseline"},
    ),
    (
        "--profile",
        {"metavar": "DIR", "help": "streams, releases: py-spy on the sidecars, stacks written to DIR"},
    ),
    ("--limit", {"type": int, "help": "streams: also a sidecar with --limit-concurrency N"}),
    ("--workers", {"help": "streams: 1,2 adds the sidecar with --workers 2 and nginx with 2 processes"}),
    (
        "--burst",
        {"type": int, "help": "streams: new connections at once amid the clients' streams (500; 0: none)"},
    ),
    ("--quiet-wait", {"type": float, "help": "streams, releases: most seconds to wait for quiet (180)"}),
    ("--modes", {"help": "streams: sidecar,router (default both)"}),
    (
        "--paths",
        {
            "help": "streams: which hops, e.g. sidecar,nginx (default all but vllm-router; direct always); "
            "vllm-router,vllm-router-w2: vLLM's P/D router beside router mode (--modes router)"
        },
    ),
    (
        "--vllm-router",
        {
            "metavar": "PATH",
            "help": "streams: the vllm-router launcher (default .tools/vllm-router, make bench)",
        },
    ),
    ("--rate", {"type": float, "help": "releases: rejected requests per second (default 2000)"}),
    ("--seconds", {"type": float, "help": "streams, releases: the measured window in seconds"}),
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--workload",
        choices=list(DEFAULT_JSON),
        default="paths",
        help="paths: JSON and SSE through each hop (default); streams: thousands of concurrent streams; "
        "releases: a steady rate of rejected requests through the release pipeline",
    )
    parser.add_argument("--quick", action="store_true", help="a smoke run of a few seconds per path")
    parser.add_argument("--json", type=Path, help="where the raw figures go (default out/bench*.json)")
    for flag, options in WORKLOAD_OPTIONS:
        parser.add_argument(flag, **options)  # type: ignore[arg-type]
    parser.add_argument(
        "--nginx",
        metavar="PATH",
        help="the nginx binary for the nginx reference path (default: nginx on PATH, if any; else skipped)",
    )
    client = parser.add_mutually_exclusive_group()
    client.add_argument(
        "--wrk", metavar="PATH", help="the wrk binary for the JSON phases (default: wrk on PATH, if any)"
    )
    client.add_argument(
        "--no-wrk",
        action="store_true",
        help="use the Python load generator for the JSON phases even if wrk is there",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    settings = QUICK if args.quick else FULL
    nginx = shutil.which(args.nginx or "nginx")
    nginx = os.path.abspath(nginx) if nginx else None
    if args.nginx and nginx is None:
        parser.error(f"--nginx {args.nginx}: not an executable")
    args.json = args.json or DEFAULT_JSON[args.workload]
    if args.workload != "paths":
        return _workload(args, nginx)
    if args.wrk and shutil.which(args.wrk) is None:
        parser.error(f"--wrk {args.wrk}: not an executable")
    if nginx is None:
        progress(
            "nginx: no nginx binary on PATH, skipping the nginx reference path (--nginx PATH to give one)"
        )
    baseline = Path(args.baseline) if args.baseline else None

    async def paths(plan: CorePlan) -> Report:
        with tempfile.TemporaryDirectory(prefix="kvr-bench-wrk-") as scratch:
            json_load = _json_load(args.wrk, args.no_wrk, settings, Path(scratch))
            return await run(settings, plan, args.quick, progress, json_load, nginx, baseline)

    return run_and_report("bench", paths, render, args.json)


def _workload(args: argparse.Namespace, nginx: str | None) -> int:
    """The streams or releases workload: run it, print its table, write its JSON."""
    from bench.releases import run as releases  # each imports what only it needs
    from bench.streams import run as streams

    if args.workload == "streams":
        return run_and_report(
            "bench",
            lambda plan: streams.run(streams.settings(args), plan, nginx, progress, args.quick),
            streams.render,
            args.json,
        )
    return run_and_report(
        "bench",
        lambda plan: releases.run(releases.settings(args), plan, progress, args.quick),
        releases.render,
        args.json,
    )


def _json_load(given: str | None, refused: bool, settings: Settings, scratch: Path) -> JsonLoad:
    """wrk when allowed and found, else the Python load generator and why (``run`` says which)."""
    body = request_body(False, settings.answer_tokens)
    found = None if refused else find_wrk(given, body, scratch)
    if found is not None:
        return found
    why = "--no-wrk given" if refused else "wrk not found on PATH (install it, e.g. apt-get install wrk)"
    return PythonJson(settings.answer_tokens, f"{why}; it may saturate its core before a hop does")
