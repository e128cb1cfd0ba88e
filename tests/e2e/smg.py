"""SGLang's gateway (smg) in front of real P and D: docs/smg.md on real engines.

``python -m tests.e2e --modes smg`` starts a decode engine that requires an API
key (``Dk``, beside the harness's D; ``tests.e2e.cluster.own_engines``), a
sidecar in front of it set as the page sets it (``--release nixl``,
``--retried-statuses none``: smg never sends P's same parameters to a second
D, ``tests/integration/test_smg_retries.py``), and ``smg launch
--pd-disaggregation`` (from ``.tools/smg``, ``make e2e`` installs it) with a
discovery file: P as a NIXL prefill worker, the sidecar as the decode worker,
both with ``model_id``. Every request goes to smg; each scenario is judged
from P's own evidence like any other:

* admitted requests (completion, chat, stream) carry D's key: D reads P's
  blocks, P ran one prefill, and the answer is the same as D's own;
* no key, not streamed: D refuses with 401 before its handler, smg retries
  the whole pair, five prefills in all, and every one is freed at once by the
  sidecar's release (five sent, none expired);
* no key, streamed: one 401, one prefill, freed by the sidecar.

The control (``smg-bare``): the same keyless request through a second smg
whose decode worker is D itself: all five prefills are held until P's lease.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import httpx

from tests.e2e.engines import Child, EngineFailed, Processes
from tests.e2e.sidecars import Peers, start_sidecar
from tests.e2e.vllmrouter import RouterFront
from tests.support.ports import free_port

#: Where ``make e2e`` (and ``make test``) install smg: requirements/smg.txt, in a virtualenv of its own.
TOOLS_SMG = Path(__file__).resolve().parents[2] / ".tools" / "smg" / "bin" / "smg"
#: Retries without a wait between attempts, and no circuit breaker: every attempt reaches D, whatever
#: the scenarios before (smg's default backoff and its breaker only make a run slower or flakier).
SMG_ARGS = ("--retry-initial-backoff-ms", "1", "--disable-circuit-breaker")


def smg_binary() -> Path | None:
    return TOOLS_SMG if TOOLS_SMG.exists() else None


def start_smg(
    processes: Processes, name: str, binary: Path, p_url: str, decode_url: str, model: str, logs: Path
) -> str:
    """``smg launch --pd-disaggregation`` with a discovery file, as the page runs it; its URL once
    both workers are ready."""
    manifest = logs / f"{name}-workers.json"
    manifest.parent.mkdir(parents=True, exist_ok=True)
    workers = [
        {"url": p_url, "worker_type": "prefill", "kv_connector": "NixlConnector", "model_id": model},
        {"url": decode_url, "worker_type": "decode", "model_id": model},
    ]
    manifest.write_text(json.dumps({"version": 1, "workers": workers}))
    port = free_port()
    command = [str(binary), "launch", "--pd-disaggregation", "--discovery-provider", "file"]
    command += ["--discovery-file", str(manifest), "--host", "127.0.0.1", "--port", str(port)]
    command += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()), *SMG_ARGS]
    child = processes.start(name, command, dict(os.environ), logs / f"{name}.log")
    url = f"http://127.0.0.1:{port}"
    wait_ready(child, url, timeout=120)
    return url


def wait_ready(child: Child, url: str, timeout: float) -> None:
    """Poll smg's ``/workers`` until both are ``ready``; ``EngineFailed`` if smg exits or never gets there."""
    deadline = time.monotonic() + timeout
    with httpx.Client(timeout=5.0, trust_env=False) as client:
        while True:
            if not child.alive():
                raise EngineFailed(f"{child.name} exited with {child.process.returncode}:\n{child.tail()}")
            try:
                workers = client.get(url + "/workers").json()["workers"]
                if len(workers) == 2 and all(worker["status"] == "ready" for worker in workers):
                    return
            except (httpx.TransportError, ValueError, KeyError):
                pass
            if time.monotonic() > deadline:
                raise EngineFailed(f"{child.name}'s workers not ready after {timeout:.0f} s:\n{child.tail()}")
            time.sleep(0.5)


def start_fronts(
    processes: Processes, binary: Path, peers: Peers, model: str, key: str, logs: Path
) -> tuple[RouterFront, RouterFront]:
    """smg with the sidecar in front of the keyed D (``peers.d_url``), and the bare smg (the control),
    each warmed by one request with D's key: a fresh smg answered its first request a minute or more
    late here (on a loaded two-core machine), past P's lease, where no scenario may start."""
    sidecar = start_sidecar(processes, "smg", peers, logs / "sidecar-smg.log")
    with_sidecar = start_smg(processes, "smg", binary, peers.p_url, sidecar.url, model, logs)
    bare = start_smg(processes, "smg-bare", binary, peers.p_url, peers.d_url, model, logs)
    body = {"model": model, "prompt": "warm up", "max_tokens": 1}
    with httpx.Client(timeout=600, trust_env=False) as client:
        for url in (with_sidecar, bare):
            answer = client.post(
                url + "/v1/completions", json=body, headers={"authorization": f"Bearer {key}"}
            )
            answer.raise_for_status()
    return RouterFront(with_sidecar, sidecar), RouterFront(bare, None)
