"""``python -m bench [--quick] [--json PATH]``: run, print the table, write the JSON.

Exit codes: 0 when the run completed, whatever the targets say (a MISS is a
finding, not a failure); 1 when the benchmark itself broke (a server would
not start or gave wrong answers); 130 on Ctrl-C.
"""

from __future__ import annotations

import argparse
import asyncio
import os
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
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    settings = QUICK if args.quick else FULL
    plan = plan_cores()
    os.sched_setaffinity(0, plan.load)  # the load generator shares D's core; D inherits it too
    try:
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            report = runner.run(run(settings, plan, args.quick, _progress))
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
