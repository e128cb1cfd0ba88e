"""What vllm-router retries in P/D mode, and with which ``kv_transfer_params``: found by test.

The sidecar must never release blocks another decode server may still read,
so ``--retried-statuses`` behind a router has to hold every status the router
retries on another D with P's same parameters; a retry that runs the prefill
again pins new blocks and makes releasing safe. docs/vllm-router.md sets
``--retried-statuses none`` from what this module finds with vllm-router
0.1.17 (requirements/vllm-router.txt):

* ``--vllm-pd-disaggregation`` retries nothing: for every status its regular
  mode retries (408, 429, 500, 502, 503, 504) and for a refused connection,
  one client request is one prefill on P and one decode attempt on one D, and
  the client gets D's status (500 for the refused connection). The router's
  source (github.com/vllm-project/router) agrees: its vLLM P/D path
  (``src/routers/http/vllm_pd_router.rs``: ``route_chat``, ``route_completion``
  and ``route_transparent`` call ``process_vllm_two_stage_request`` once) sends
  the decode leg once and turns a send error into a 500 ("Transparent proxy
  request failed", the body the refused case gets here), while the regular
  router (``src/routers/http/router.rs``) wraps each request in
  ``RetryExecutor::execute_response_with_retry`` with ``is_retryable_status``
  (``src/core/retry.rs``: 408, 429, 500, 502, 503, 504).
* The regular mode (``--worker-urls``) does retry a 503 on another worker:
  the control below shows that the counts used here see a retry when there is
  one.

P is the prefill simulator (real NIXL agents, pins that never expire, so
every prefill stays counted); both decode servers are decode simulators that
log each request's ``kv_transfer_params``. A status is asked for with the
simulator's ``[[reject:N]]`` prompt marker, which both decode servers honour:
a retry on the other one would be logged there with the same parameters.
If a later vllm-router retries the decode leg, this module fails and names
the status.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from sidecar.sim.decode import create_decode_app
from sidecar.sim.decode.config import DecodeSimConfig
from sidecar.sim.prefill import PrefillSimConfig, create_prefill_app
from sidecar.sim.servers import ServerThread, serve
from tests.deploy.manifests import ROOT
from tests.integration.guides import in_own_group
from tests.support.ports import free_port

pytestmark = pytest.mark.nixl

ROUTER = ROOT / ".tools" / "vllm-router" / "bin" / "vllm-router"
MODEL = "sim-model"
#: What vllm-router's regular mode retries (``is_retryable_status``), each asked of D in P/D mode.
RETRIED_ELSEWHERE = (408, 429, 500, 502, 503, 504)


@contextmanager
def vllm_router(args: list[str], log: Path) -> Iterator[str]:
    """vllm-router with ``args`` on a free port, in its own process group; its URL once healthy."""
    if not ROUTER.exists():
        pytest.fail(f"{ROUTER.relative_to(ROOT)} is missing: make test creates it")
    port = free_port()
    command = [str(ROUTER), *args, "--host", "127.0.0.1", "--port", str(port)]
    command += ["--prometheus-port", str(free_port()), "--worker-startup-check-interval", "1"]
    url = f"http://127.0.0.1:{port}"
    with in_own_group(command, log, lambda: _healthy(url)):
        yield url


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=1).status_code == 200
    except httpx.TransportError:
        return False


@dataclass
class Cluster:
    p: ServerThread
    decoders: list[ServerThread]
    router: str

    def pinned(self) -> int:
        """Prefills P has run (each pins the prompt's blocks)."""
        return int(httpx.get(self.p.url + "/stats", timeout=5).json()["requests_pinned"])

    def attempts(self) -> list[dict[str, Any]]:
        """Every request the decode servers got, in arrival order per server."""
        return [entry for d in self.decoders for entry in httpx.get(d.url + "/sim/log", timeout=5).json()]


@contextmanager
def cluster(tmp_path: Path, *, pd: bool = True, extra: tuple[str, ...] = ()) -> Iterator[Cluster]:
    """P, two decode servers and vllm-router (P/D mode, or with ``pd`` False its regular mode),
    ``extra`` added to the router's flags."""
    p_config = PrefillSimConfig(port=0, lease=0, side_channel_port=0, model=MODEL)
    d_config = DecodeSimConfig(port=0, model=MODEL, log_params=True)
    with ExitStack() as stack:
        p = stack.enter_context(serve(create_prefill_app(p_config)))
        decoders = [stack.enter_context(serve(create_decode_app(d_config))) for _ in range(2)]
        if pd:
            args = ["--vllm-pd-disaggregation", "--prefill", p.url]
            args += [arg for d in decoders for arg in ("--decode", d.url)]
        else:
            args = ["--worker-urls", *(d.url for d in decoders)]
        args += ["--policy", "round_robin", *extra]
        router = stack.enter_context(vllm_router(args, tmp_path / "router.log"))
        yield Cluster(p, decoders, router)


def ask(url: str, text: str) -> httpx.Response:
    body = {"model": MODEL, "prompt": text, "max_tokens": 4}
    return httpx.post(url + "/v1/completions", json=body, timeout=60)


#: The regular mode's retry settings, given explicitly: P/D mode ignores them.
RETRY_FLAGS = ("--retry-max-retries", "5", "--retry-initial-backoff-ms", "1")


def test_pd_mode_retries_no_status_on_another_decode_server(tmp_path: Path) -> None:
    with cluster(tmp_path, extra=RETRY_FLAGS) as pd:
        for status in RETRIED_ELSEWHERE:
            for turn in range(2):  # round robin: once toward each decode server
                pinned, attempts = pd.pinned(), len(pd.attempts())
                answer = ask(pd.router, f"asked {status} turn {turn} [[reject:{status}]]")
                assert answer.status_code == status, answer.text
                assert len(pd.attempts()) == attempts + 1, f"{status}: the decode leg was sent again"
                assert pd.pinned() == pinned + 1, f"{status}: the prefill ran again"
        params = [entry["kv_transfer_params"] for entry in pd.attempts()]
        assert all(p and p["do_remote_prefill"] for p in params)  # every decode leg carried P's
        ids = [p["remote_request_id"] for p in params]
        assert len(ids) == len(set(ids)) == 2 * len(RETRIED_ELSEWHERE)  # never the same twice


def test_pd_mode_does_not_retry_a_refused_connection(tmp_path: Path) -> None:
    with cluster(tmp_path) as pd:
        down, up = pd.decoders
        down.stop()  # its port now refuses connections; the router still lists it as healthy
        statuses = []
        for turn in range(4):  # round robin: twice toward each decode server
            pinned, attempts = pd.pinned(), len(log_of(up))
            answer = ask(pd.router, f"refused turn {turn}")
            statuses.append(answer.status_code)
            assert pd.pinned() == pinned + 1  # one prefill per request, whatever happened next
            reached = len(log_of(up)) - attempts
            assert reached == (answer.status_code == 200), (turn, answer.status_code, answer.text[:300])
            if answer.status_code != 200:
                assert "Decode request failed" in answer.text  # the router's own answer, not D's
        assert sorted(statuses) == [200, 200, 500, 500]  # the refused half reached the client as 500


def log_of(d: ServerThread) -> list[dict[str, Any]]:
    return list(httpx.get(d.url + "/sim/log", timeout=5).json())


def test_the_regular_mode_retries_and_the_counts_see_it(tmp_path: Path) -> None:
    with cluster(tmp_path, pd=False, extra=RETRY_FLAGS) as regular:
        answer = ask(regular.router, "both refuse [[reject:503]]")
        assert answer.status_code == 503
        assert len(regular.attempts()) == 5  # the same request, sent again: what P/D mode never does
