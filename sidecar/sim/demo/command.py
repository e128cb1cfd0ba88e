"""``kv-release-sidecar demo``: what the sidecar saves P, measured on loopback in under a minute.

Runs the same P->D load twice against a cluster built in this process
(``demo_cluster``: the prefill simulator with TP 2, a small pool and a short
lease; the decode simulator in "vLLM D" mode; the sidecar with the NIXL
strategy and allowlist 127.0.0.1): once with releases off, once with
``--release nixl``. The load (``demo_workload``) is the load generator's,
with a share of requests D rejects for realistic reasons. Prints both runs
side by side and who frees P's blocks for each rejection cause, writes a
PNG of P's pinned blocks and refusals over time and a JSON report under
``--out`` (``out/demo/``), and exits 1 when something is clearly wrong (see
``demo_report.problems``). ``--vllm-version 0.18.0`` shows a D without
vLLM's own fix; ``--quick`` is the short run the test suite uses.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any, TextIO

import aiohttp
import msgspec

from sidecar.loadtest.config import LoadConfig
from sidecar.loadtest.plot import run_from_report, write_plot
from sidecar.loadtest.probes import sidecar_counters
from sidecar.loadtest.runner import run_loadtest
from sidecar.observability import logs
from sidecar.sim.demo.cluster import ClusterSettings, ClusterUrls, demo_cluster
from sidecar.sim.demo.report import DemoRun, figures, problems, render
from sidecar.sim.demo.workload import API_KEY, FIX_RELEASE, demo_workload
from sidecar.sim.prefill.release import UnsupportedVersion, parse_version

MAX_MODEL_LEN = 256  # D's, in words
ADMISSION_LIMIT = 4  # D's unfinished requests before it answers 503 (vLLM 0.29.0+)
ADMISSION_SINCE = (0, 29, 0)
OLDEST_SAFE = (0, 10, 1)  # older P engines die on a notification for an id they no longer hold
RUNS = (("releases off", "off"), ("releases on (nixl)", "nixl"))
# The demo's mix is built for D to reject about 40 % of what it is sent (see demo_workload): the
# verdict fails a run only when D rejects more than this share, as with a model mismatch.
REJECTED_SHARE = 0.6


class Scale(msgspec.Struct, frozen=True, kw_only=True):
    """How long and how hard the demo runs."""

    rate: float
    duration: float
    lease: float
    num_blocks: int
    sample_interval: float


FULL = Scale(rate=40.0, duration=8.0, lease=6.0, num_blocks=192, sample_interval=0.1)
QUICK = Scale(rate=40.0, duration=3.0, lease=2.5, num_blocks=128, sample_interval=0.05)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="a short run (the test suite's)")
    parser.add_argument("--vllm-version", default="0.34.0", help="vLLM release of P and D (default 0.34.0)")
    parser.add_argument("--out", default="out/demo", help="directory of the PNG and JSON (default out/demo)")
    parser.add_argument("--seed", type=int, default=7, help="seed of arrivals and prompts (default 7)")
    parser.add_argument("--quiet", action="store_true", help="print nothing, only the exit code")


def _settings(scale: Scale, version: str, release: str) -> ClusterSettings:
    return ClusterSettings(
        vllm_version=version,
        release="nixl" if release == "nixl" else "off",
        num_blocks=scale.num_blocks,
        lease=scale.lease,
        max_model_len=MAX_MODEL_LEN,
        max_concurrency=ADMISSION_LIMIT if parse_version(version) >= ADMISSION_SINCE else 0,
        api_key=API_KEY,
    )


def _load(scale: Scale, urls: ClusterUrls, seed: int) -> LoadConfig:
    return LoadConfig(
        prefill_url=urls.prefill,
        decode_url=urls.sidecar,
        rate=scale.rate,
        duration=scale.duration,
        stream_share=0.5,
        route="chat",
        max_prompt=192,
        seed=seed,
        sidecar_admin_url=urls.sidecar_admin,
        api_key=API_KEY,
        sample_interval=scale.sample_interval,
        drain_timeout=scale.lease + 5.0,
        max_rejected_share=REJECTED_SHARE,
        progress="bar" if sys.stderr.isatty() else "off",
    )


async def _down_counters(urls: ClusterUrls) -> dict[str, float]:
    async with aiohttp.ClientSession(trust_env=False) as session:
        return await sidecar_counters(session, urls.down_sidecar_admin)


def _one_run(scale: Scale, version: str, label: str, release: str, seed: int) -> DemoRun:
    with demo_cluster(_settings(scale, version, release)) as urls:
        workload = demo_workload(urls.down_sidecar, MAX_MODEL_LEN)
        report = asyncio.run(run_loadtest(_load(scale, urls, seed), workload))
        down = asyncio.run(_down_counters(urls))
    return DemoRun(label, release, report, down)


def _admission(version: str) -> str:
    if parse_version(version) >= ADMISSION_SINCE:
        return f"admission control above {ADMISSION_LIMIT} requests"
    return "no admission control before vLLM 0.29.0"


def _explain(version: str, lease: float) -> list[str]:
    if parse_version(version) >= FIX_RELEASE:
        return [
            f"vLLM {version}'s D frees the rejections its completion handler raises itself (0.21.0+,",
            "notify_kv_transfer_request_rejected): unknown model, prompt over max_model_len, and",
            "admission control's 503 (0.29.0+). With releases on, the sidecar leaves those to D",
            "(covered_by_engine) and releases the rest, which D's fix cannot see: request validation",
            "and auth answer before the handler, a D that is down never sees the request, and a",
            "stream's admission failure comes after HTTP 200. Without the sidecar those hold P's",
            f"blocks until P's lease expires ({lease:g} s here, 30 s by default in vLLM 0.22.0+).",
        ]
    return [
        f"vLLM {version}'s D frees no rejected request itself (its fix came in 0.21.0): without the",
        f"sidecar every rejection holds P's blocks until P's lease expires ({lease:g} s here; 480 s by",
        "default in 0.11.1-0.21.x). With releases on, the sidecar frees them all at once.",
    ]


def run_demo(scale: Scale, version: str, out_dir: Path, seed: int, out: TextIO) -> int:
    """Both runs, the report, the files; the exit code."""
    print(
        f"kv-release-sidecar demo: P (simulator, vLLM {version}, TP 2, {scale.num_blocks} KV blocks of 16 "
        f"tokens, lease {scale.lease:g} s)\n  -> sidecar (NIXL release, allowlist 127.0.0.1) -> D (simulator "
        f'in "vLLM D" mode, max_model_len {MAX_MODEL_LEN}, {_admission(version)})\n'
        f"each run: chat requests arriving at {scale.rate:g}/s (Poisson) for {scale.duration:g} s, half "
        "streaming, the same requests in both runs (same seed)\n",
        file=out,
    )
    runs = []
    for number, (label, release) in enumerate(RUNS, start=1):
        started = time.monotonic()
        runs.append(_one_run(scale, version, label, release, seed))
        print(f"run {number}/2, {label}: done in {time.monotonic() - started:.1f} s", file=out, flush=True)
    print("\n" + render(runs, version) + "\n\n" + "\n".join(_explain(version, scale.lease)), file=out)
    found = problems(runs)
    report_path, plot_path = _write(out_dir, runs, version, scale, found)
    print(
        f"\nplot of P's pinned blocks and refusals over time: {plot_path}\nJSON report: {report_path}",
        file=out,
    )
    if found:
        print("\nSOMETHING IS WRONG:\n  " + "\n  ".join(found), file=out)
        return 1
    print("\nevery check passed: no wrong release, fewer pinned block-seconds with releases on.", file=out)
    return 0


def _write(
    out_dir: Path, runs: list[DemoRun], version: str, scale: Scale, found: list[str]
) -> tuple[Path, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    document: dict[str, Any] = {
        "vllm_version": version,
        "scale": msgspec.to_builtins(scale),
        "problems": found,
        "runs": {
            run.release: {"label": run.label, "figures": figures(run), "report": run.report} for run in runs
        },
    }
    report_path = out_dir / "report.json"
    report_path.write_bytes(msgspec.json.format(msgspec.json.encode(document), indent=2))
    capacity = runs[0].report["p"]["blocks_total"]
    title = f"P's pinned KV blocks, vLLM {version}: releases off vs on"
    plotted = [run_from_report(run.label, run.report) for run in runs]
    plot_path = write_plot(out_dir / "pinned_blocks.png", plotted, capacity, title, latency=False)
    return report_path, plot_path


def _quiet_nixl() -> None:
    """NIXL configures its own logger, printing INFO to stdout; keep the table readable."""
    try:
        import nixl_cu12._api  # noqa: F401 - importing configures the "nixl" logger
    except ImportError:  # pragma: no cover - the demo needs NIXL; the cluster start says so
        return
    logging.getLogger("nixl").setLevel(logging.WARNING)


def _version_error(version: str) -> str:
    try:
        if parse_version(version) < OLDEST_SAFE:
            return "the demo needs vLLM 0.10.1+ (older P engines die on a stray notification)"
    except UnsupportedVersion as exc:
        return str(exc)
    return ""


def run(args: argparse.Namespace) -> int:
    problem = _version_error(args.vllm_version)
    if problem:
        print(f"demo: --vllm-version {args.vllm_version}: {problem}", file=sys.stderr)
        return 2
    logs.setup("error", "text")
    _quiet_nixl()
    scale = QUICK if args.quick else FULL
    out_dir = Path(args.out)
    if args.quiet:
        with open(os.devnull, "w") as devnull:
            return run_demo(scale, args.vllm_version, out_dir, args.seed, devnull)
    return run_demo(scale, args.vllm_version, out_dir, args.seed, sys.stdout)
