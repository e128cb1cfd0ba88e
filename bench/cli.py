"""``python -m bench [--quick] [--json PATH] [--nginx PATH]``: run, print the table, write the JSON.

nginx, the optional fourth path, is measured when an ``nginx`` binary is on
``PATH`` or given with ``--nginx``; otherwise one progress line says it was
skipped. The bench never installs it.

Exit codes: 0 when the run completed, whatever the targets say (a MISS is a
finding, not a failure); 1 when the benchmark itself broke (a server would
not start or gave wrong answers); 2 on bad arguments; 130 on Ctrl-C.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

import uvloop

from bench.procs import BenchError, plan_cores
from bench.report import render, write_json
from bench.run import run
from bench.settings import FULL, QUICK

DEFAULT_JSON = Path("out/bench.json")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run of a few hundred requests")
    parser.add_argument(
        "--json", type=Path, default=DEFAULT_JSON, help=f"where the raw figures go (default {DEFAULT_JSON})"
    )
    parser.add_argument(
        "--nginx",
        metavar="PATH",
        help="the nginx binary for the nginx reference path (default: nginx on PATH, if any; else skipped)",
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
    if nginx is None:
        _progress(
            "nginx: no nginx binary on PATH, skipping the nginx reference path (--nginx PATH to give one)"
        )
    plan = plan_cores()
    os.sched_setaffinity(0, plan.load)  # the load generator shares D's core; D inherits it too
    try:
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            report = runner.run(run(settings, plan, args.quick, _progress, nginx))
    except BenchError as exc:
        print(f"bench: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    write_json(report, args.json)
    print(render(report))
    print(f"raw figures: {args.json}")
    return 0


def _progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
