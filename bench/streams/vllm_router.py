"""vLLM's own P/D router (``vllm-router``) as a hop of the many-streams workload's router mode.

``vllm-router --vllm-pd-disaggregation --prefill P --decode D`` (a Rust
server in a Python launcher, in-process: its threads are the launcher's
process) runs each request as the sidecar in router mode does: a prefill leg
on P (``stream`` false, ``max_tokens`` 1, ``min_tokens`` 1, ``kv_transfer_params``
with ``do_remote_decode``, an ``X-Request-Id`` header), then the client's body
with P's ``kv_transfer_params`` to D (the same header), streamed back.

It runs with ``--policy round_robin``: with one P and one D every policy picks
the same servers, and its default (``cache_aware``) also sends a
``/v1/chat/completions/render`` request to P and to D before each request
(four requests per stream instead of two) to tokenize the prompt for its
prefix tree. Its worker threads are left to their default, one per CPU it
may run on: one when pinned to the hop's CPU, two on both. ``make bench``
installs it into ``.tools/vllm-router`` (requirements/vllm-router.txt).
"""

from __future__ import annotations

from pathlib import Path

from bench.harness.procs import HOST, BenchError
from tests.support.ports import free_port

INSTALLED = Path(__file__).resolve().parents[2] / ".tools" / "vllm-router" / "bin" / "vllm-router"

#: What each router-mode hop sends P and D per stream, printed beside the figures (the fake P's
#: counts, printed beside them, show what came).
SENDS = {
    "sidecar": "P: the body with stream false, max_tokens 1, kv_transfer_params do_remote_decode, "
    "X-Request-Id; D: the client's body with P's kv_transfer_params",
    "vllm-router": "P: the same and min_tokens 1; D: the same (--policy round_robin: no /render requests)",
}


def argv(binary: str, prefill_url: str, decode_url: str, port: int) -> list[str]:
    """The router's command line as docs/vllm-router.md runs it, on ``port``; it checks its servers
    every second at start-up (its default: every 30 s) and serves metrics on a free port."""
    if not Path(binary).exists():
        raise BenchError(f"vllm-router not found at {binary}: make bench installs it (or --vllm-router PATH)")
    return [
        binary, "--vllm-pd-disaggregation", "--prefill", prefill_url, "--decode", decode_url,
        "--host", HOST, "--port", str(port), "--prometheus-port", str(free_port()),
        "--policy", "round_robin", "--worker-startup-check-interval", "1",
    ]  # fmt: skip
