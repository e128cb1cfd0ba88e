"""vLLM's own P/D router in front of real P and D: docs/vllm-router.md on real engines.

``python -m tests.e2e --modes vllm-router`` starts ``vllm-router
--vllm-pd-disaggregation`` (installed into the engines' environment by
``tests.e2e.setup_env``) with P as its prefill server and, as its decode
server, a sidecar in front of D set as the page sets it (``--release nixl``,
``--retried-statuses none``: vllm-router's P/D mode retries no decode leg,
``tests/integration/test_vllm_router_retries.py``). Every request goes to the
router, which runs the prefill leg on P and the decode leg through the
sidecar; each scenario is judged from P's own evidence like any other:

* admitted requests (completion, chat, stream): D reads P's blocks and the
  answer is the same as D's own;
* ``stream_options`` without ``stream``: the router drops it from P's leg, D
  refuses the decode leg before its handler (400), the sidecar frees P's
  blocks at once;
* ``max_tokens`` over D's context (P's leg asks for one token): D's handler
  refuses it and D's own cleanup frees P, the sidecar sends nothing;
* D stopped: the sidecar's 503 passes through the router, and is released.

The control (``vllm-router-bare``): the same refusal through a second
vllm-router whose decode server is D itself, no sidecar: P's lease frees the
blocks.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import httpx

from tests.e2e.engines import Processes, wait_healthy
from tests.e2e.sidecars import Peers, SidecarProcess, start_sidecar
from tests.support.ports import free_port

#: Where ``make test`` installs vllm-router (``requirements/vllm-router.txt``), for a run against
#: engines the harness did not start (``--p-url``).
TOOLS_ROUTER = Path(__file__).resolve().parents[2] / ".tools" / "vllm-router" / "bin" / "vllm-router"
#: The router's health checks every hour: the D-down scenario measures the sidecar's answer for a D
#: that went away, not how soon the router stops sending to it (its default: every 60 s, out after 3).
ROUTER_ARGS = ("--health-check-interval-secs", "3600", "--worker-startup-check-interval", "1")


def router_binary(engine_python: str) -> Path | None:
    """vllm-router beside the engines' Python, else where ``make test`` puts it; None if neither."""
    candidates = [Path(engine_python).parent / "vllm-router"] if engine_python else []
    for path in [*candidates, TOOLS_ROUTER]:
        if path.exists():
            return path
    return None


@dataclass
class RouterFront:
    """vllm-router in front of P and of the sidecar (or, for the control, of D itself)."""

    url: str
    sidecar: SidecarProcess | None

    def metrics(self, client: httpx.Client) -> str:
        """The sidecar's metrics; the bare router's control has none (nothing it could release)."""
        return self.sidecar.metrics(client) if self.sidecar is not None else ""


def start_router(
    processes: Processes, name: str, binary: Path, p_url: str, decode_url: str, log: Path
) -> str:
    """``vllm-router --vllm-pd-disaggregation`` on a free port, as the page runs it; its URL once healthy."""
    port = free_port()
    command = [str(binary), "--vllm-pd-disaggregation", "--prefill", p_url, "--decode", decode_url]
    command += ["--host", "127.0.0.1", "--port", str(port), "--prometheus-port", str(free_port())]
    command += ROUTER_ARGS
    child = processes.start(name, command, dict(os.environ), log)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(child, url + "/health", timeout=120)
    return url


def start_fronts(
    processes: Processes, binary: Path, peers: Peers, logs: Path
) -> tuple[RouterFront, RouterFront]:
    """The router with the sidecar in front of D, and the bare router (the control)."""
    sidecar = start_sidecar(processes, "vllm-router", peers, logs / "sidecar-vllm-router.log")
    with_sidecar = start_router(
        processes, "vllm-router", binary, peers.p_url, sidecar.url, logs / "vllm-router.log"
    )
    bare = start_router(
        processes, "vllm-router-bare", binary, peers.p_url, peers.d_url, logs / "vllm-router-bare.log"
    )
    return RouterFront(with_sidecar, sidecar), RouterFront(bare, None)
