"""``kv-release-sidecar loadtest``: flags in, a run, the table out; the exit code is the verdict.

Exit codes: 0 the verdict passed, 1 it failed (a wrong release, an admitted
request without its tokens) or P/D could not be reached, 2 a bad flag.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from pathlib import Path
from typing import Any

import aiohttp
import msgspec

from sidecar.config import ConfigError
from sidecar.loadtest.config import LoadConfig, add_arguments, config_from_args
from sidecar.loadtest.plot import run_from_report, write_plot
from sidecar.loadtest.report import render_table
from sidecar.loadtest.runner import run_loadtest
from sidecar.observability import logs

__all__ = ["add_arguments", "run", "write_outputs"]


def write_outputs(config: LoadConfig, report: dict[str, Any]) -> list[str]:
    """Write the JSON report and the plot the config asks for; returns what was written."""
    written = []
    if config.report:
        path = Path(config.report)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(msgspec.json.format(msgspec.json.encode(report), indent=2))
        written.append(f"report: {path}")
    if config.plot:
        capacity = report["p"]["blocks_total"]  # None when P's pool size is unknown: the plot shows %
        title = f"loadtest against {config.decode_url}"
        path = write_plot(config.plot, [run_from_report("this run", report)], capacity, title)
        written.append(f"plot: {path}")
    return written


def run(args: argparse.Namespace) -> int:
    """Run the load test the flags describe (see the module docstring)."""
    try:
        config = config_from_args(args)
    except ConfigError as exc:
        print(f"loadtest: {exc}", file=sys.stderr)
        return 2
    if not logging.getLogger().handlers:  # keep a host's logging (tests, embedding) as it is
        logs.setup("warning", "text")
    try:
        report = asyncio.run(run_loadtest(config))
    except KeyboardInterrupt:
        print("loadtest: interrupted", file=sys.stderr)
        return 130
    except (TimeoutError, aiohttp.ClientError, OSError, msgspec.DecodeError, KeyError) as exc:
        print(f"loadtest: cannot run against P or D: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    print(render_table(report))
    for line in write_outputs(config, report):
        print(line)
    return 0 if report["verdict"]["ok"] else 1
