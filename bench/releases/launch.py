"""The three servers of the rejection workloads as child processes: P, D and the sidecar releasing over NIXL.

Both ``python -m bench --workload releases`` and ``bench.storm`` run them.

The same way as ``bench.harness.procs``: each child is ``python -m sidecar ...`` in a
session of its own, pinned before exec (the sidecar on its own core, P and D
on the load core beside the load generators), dying with this process, and
polled for readiness against a deadline (P's and D's ``GET /health``, the
sidecar's ``GET /readyz``, which needs its NIXL agent up).

P (``sim-prefill``) speaks vLLM 0.33.0's side channel with one TP worker, a
pool large enough for every prepared request and no lease, so a block is
freed only by a notification and every release the sidecar sends shows up in
P's ``freed_by_notification``. D (``sim-decode``) is plain (it notifies no
one) and serves P's model name. The sidecar runs ``--release nixl`` for
0.33.0 with P's loopback address allowed.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from bench.harness.procs import HOST, STOP_TIMEOUT, Child, CorePlan, sidecar_argv, wait_all_ready
from tests.support.ports import free_port

VLLM_VERSION = "0.34.0"
MODEL = "sim-prefill"  # P's default model name; D serves the same
PROMPT = "tok tok tok tok tok tok tok tok"  # 8 words: one 16-token block on P
PREFILL_BLOCKS = 200_000
BLOCK_SIZE = 16
MAX_MODEL_LEN = 64


@dataclass(frozen=True, slots=True)
class Hop:
    """One sidecar in front of D: this tree's, or another checkout's (``launched(baseline=...)``)."""

    name: str
    child: Child
    url: str
    admin_url: str


@dataclass(frozen=True, slots=True)
class StormServers:
    prefill: Child
    decode: Child
    sidecar: Child
    prefill_url: str
    decode_url: str
    sidecar_url: str
    admin_url: str
    others: tuple[Hop, ...] = ()  # more sidecars in front of the same D (another checkout's)

    @property
    def hops(self) -> tuple[Hop, ...]:
        return (Hop("sidecar", self.sidecar, self.sidecar_url, self.admin_url), *self.others)

    @property
    def children(self) -> tuple[Child, ...]:
        return (self.prefill, self.decode, self.sidecar, *(hop.child for hop in self.others))

    def logs(self) -> str:
        return "\n".join(f"--- {child.name} log:\n{child.log_tail()}" for child in self.children)


def _serve_argv(
    decode_url: str, port: int, admin_port: int, queue_size: int, workers: int, checkout: Path | None = None
) -> list[str]:
    return sidecar_argv(
        "serve",
        "--decode-url", decode_url,
        "--host", HOST,
        "--port", str(port),
        "--admin-host", HOST,
        "--admin-port", str(admin_port),
        "--release", "nixl",
        "--prefill-allow", HOST,
        "--vllm-version", VLLM_VERSION,
        "--release-queue-size", str(queue_size),
        "--release-workers", str(workers),
        "--log-level", "error",
        "--drain-timeout", "2",
        "--flush-timeout", "1",
        checkout=checkout,
    )  # fmt: skip


@contextlib.contextmanager
def launched(
    plan: CorePlan,
    release_queue_size: int,
    release_workers: int,
    tp: int = 1,
    fast_decode: bool = False,
    baseline: Path | None = None,
) -> Iterator[StormServers]:
    """Start P, D and the sidecar (not yet known ready); stop them all on exit.

    ``tp``: P's tensor-parallel workers. ``fast_decode``: D is ``bench.servers.fakes --role reject``
    (every completion refused before its handler, at a fraction of sim-decode's CPU) instead of
    sim-decode. ``baseline``: another checkout whose sidecar runs too, beside this tree's, in front
    of the same D and on the same core (``StormServers.others``, named "baseline").
    """
    p_port, d_port, s_port, a_port = free_port(), free_port(), free_port(), free_port()
    urls = [f"http://{HOST}:{port}" for port in (p_port, d_port, s_port, a_port)]
    started: list[Child] = []
    with tempfile.TemporaryDirectory(prefix="kvr-bench-storm-") as logs:
        log_dir = Path(logs)
        try:
            started.append(Child("sim-prefill", sidecar_argv(
                "sim-prefill",
                "--host", HOST,
                "--port", str(p_port),
                "--vllm-version", VLLM_VERSION,
                "--tp", str(tp),
                "--num-blocks", str(PREFILL_BLOCKS),
                "--block-size", str(BLOCK_SIZE),
                "--lease", "0",
                "--side-channel-port", "0",
                "--log-level", "warning",
            ), plan.load, log_dir))  # fmt: skip
            d_argv = sidecar_argv(
                "sim-decode",
                "--host", HOST,
                "--port", str(d_port),
                "--version", VLLM_VERSION,
                "--served-model", MODEL,
                "--max-model-len", str(MAX_MODEL_LEN),
            )  # fmt: skip
            if fast_decode:
                d_argv = [sys.executable, "-m", "bench.servers.fakes", "--role", "reject"]
                d_argv += ["--port", str(d_port)]
            started.append(Child("fake-decode" if fast_decode else "sim-decode", d_argv, plan.load, log_dir))
            queue, workers = release_queue_size, release_workers
            argv = _serve_argv(urls[1], s_port, a_port, queue, workers)
            started.append(Child("sidecar", argv, plan.sidecar, log_dir))
            others: list[Hop] = []
            if baseline is not None:
                b_port, b_admin = free_port(), free_port()
                argv = _serve_argv(urls[1], b_port, b_admin, queue, workers, baseline)
                child = Child("baseline", argv, plan.sidecar, log_dir)
                started.append(child)
                others.append(Hop("baseline", child, f"http://{HOST}:{b_port}", f"http://{HOST}:{b_admin}"))
            prefill, decode, sidecar = started[:3]
            prefill_url, decode_url, sidecar_url, admin_url = urls
            yield StormServers(
                prefill, decode, sidecar, prefill_url, decode_url, sidecar_url, admin_url, tuple(others)
            )
        finally:
            _stop(started)


def _stop(children: list[Child]) -> None:
    """SIGTERM to all at once (each shuts down on its own), then ``Child.stop`` (SIGKILL if stuck)."""
    for child in children:
        if child.process.poll() is None:
            child.process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + STOP_TIMEOUT
    for child in children:
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.process.wait(max(0.0, deadline - time.monotonic()))
        child.stop()


async def wait_ready(servers: StormServers, deadline: float) -> None:
    """Poll P's and D's ``/health``, then each sidecar's ``/readyz``, until 200 or ``deadline``."""
    ready = {servers.prefill: servers.prefill_url + "/health", servers.decode: servers.decode_url + "/health"}
    await wait_all_ready(ready | {hop.child: hop.admin_url + "/readyz" for hop in servers.hops}, deadline)
