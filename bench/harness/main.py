"""A bench's command line: its common flags, its run on uvloop, its table, its JSON, its exit code.

Exit codes: 0 when the run completed, whatever the targets say (a MISS is a
finding, not a failure); 1 when the benchmark itself broke (a server would
not start or gave wrong answers); 130 on Ctrl-C.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import uvloop

from bench.harness.procs import BenchError, CorePlan, plan_cores
from bench.harness.report import write_json

_Report = TypeVar("_Report", bound=msgspec.Struct | dict[str, Any])


def bench_parser(module: str, doc: str, json: Path, quick: str, json_help: str) -> argparse.ArgumentParser:
    """The flags of ``python -m <module>`` that every bench module has: ``--quick`` (``quick`` says
    how long that is) and ``--json PATH`` (default ``json``)."""
    parser = argparse.ArgumentParser(prog=f"python -m {module}", description=doc.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help=quick)
    parser.add_argument("--json", type=Path, default=json, help=f"{json_help} (default {json})")
    return parser


def run_and_report(
    prog: str,
    work: Callable[[CorePlan], Coroutine[Any, Any, _Report]],
    render: Callable[[_Report], str],
    json_path: Path,
) -> int:
    """Every bench's main after its flags: pin this process to the load core (the children it starts
    pick their own; wrk inherits it), run ``work`` on uvloop, write its report to ``json_path`` and
    print its table. Exit code 0 when the run completed, 1 when the benchmark itself broke (said on
    stderr after ``prog``), 130 on Ctrl-C."""
    plan = plan_cores()
    os.sched_setaffinity(0, plan.load)
    try:
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            report = runner.run(work(plan))
    except BenchError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    write_json(report, json_path)
    print(render(report))
    print(f"raw figures: {json_path}")
    return 0


def progress(line: str) -> None:
    """A progress line, on stderr."""
    print(line, file=sys.stderr, flush=True)
