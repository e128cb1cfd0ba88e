"""With SSRF protection and an API server that does not answer, the sidecar answers at once and stops at once.

The sidecar runs as a process with the guides' args plus ``--enable-ssrf-protection
--inference-pool``; the Kubernetes API is either a closed port (connections
refused) or a socket that accepts connections and never answers. The pool's
first list is then pending for the whole ``FIRST_SYNC_SECONDS`` (10 s). During
that window the serving port answers 503 in llm-d's shape with the "starting"
message (only a request answered inside the window can carry it: after it, the
request would be refused or sent to D), ``/health`` answers 200 as llm-d's does,
``/readyz`` is 503, and a SIGTERM ends the process with exit 0; the same with
two workers, whose supervisor watches the pool (``sidecar.k8s.shared``).

The answer is judged by its body, not by a clock: only an answer given inside
the window says "starting". The exit has a bound with its margin: within
``EXIT_WITHIN`` (5 s) of SIGTERM, sent while the pool is still pending; a server
that waited for the first list would take up to the full 10 s.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import trustme

from sidecar.app.core import NOT_STARTED
from sidecar.k8s import FIRST_SYNC_SECONDS
from tests.support.ports import free_port

pytestmark = pytest.mark.nixl
GUIDE_ARGS = ["--kv-connector=nixlv2", "--zap-log-level=1", "--secure-serving=false"]
EXIT_WITHIN = 5.0


@contextmanager
def api_server(kind: str) -> Iterator[int]:
    """The port of an API server that refuses connections, or that accepts them and never answers."""
    if kind == "refused":
        yield free_port()  # nothing listens there
        return
    with socket.socket() as listener:  # the kernel completes handshakes; nobody reads or answers
        listener.bind(("127.0.0.1", 0))
        listener.listen(64)
        yield listener.getsockname()[1]


def account(tmp: Path) -> Path:
    directory = tmp / "serviceaccount"
    directory.mkdir()
    (directory / "token").write_text("token")
    (directory / "namespace").write_text("llm")
    trustme.CA().cert_pem.write_to_path(str(directory / "ca.crt"))
    return directory


def first_answer(url: str, deadline: float) -> httpx.Response:
    """The first answer of the serving port once it accepts connections."""
    while True:
        try:
            socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])), timeout=1).close()
            break
        except OSError:
            assert time.monotonic() < deadline, "the serving port never listened"
            time.sleep(0.05)
    return httpx.post(url + "/v1/completions", json={"prompt": "x"}, timeout=FIRST_SYNC_SECONDS + 5)


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("api", ["refused", "silent"])
def test_the_serving_port_answers_and_sigterm_stops_while_the_pool_is_first_listed(
    tmp_path: Path, api: str, workers: int
) -> None:
    port, admin = free_port(), free_port()
    args = [f"--port={port}", f"--vllm-port={free_port()}", *GUIDE_ARGS]
    args += ["--enable-ssrf-protection", "--inference-pool=llm/pool"]
    with api_server(api) as api_port, tempfile.TemporaryFile() as log:
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVR_")}
        env |= {
            "KUBERNETES_SERVICE_HOST": "127.0.0.1",
            "KUBERNETES_SERVICE_PORT": str(api_port),
            "KVR_KUBE_SERVICE_ACCOUNT": str(account(tmp_path)),
            "KVR_ADMIN_PORT": str(admin),
            "KVR_WORKERS": str(workers),  # 2: the supervisor watches, each worker waits for its lists
        }
        process = subprocess.Popen(
            [sys.executable, "-m", "sidecar", "serve", *args], env=env, stdout=log, stderr=subprocess.STDOUT
        )
        try:
            url = f"http://127.0.0.1:{port}"
            response = first_answer(url, time.monotonic() + 60)
            assert response.status_code == 503, response.text
            # answered inside the first-list window: no clock needed, only then can it say "starting"
            assert NOT_STARTED in response.text
            assert httpx.get(url + "/health", timeout=5).status_code == 200  # llm-d's, as always
            ready = httpx.get(f"http://127.0.0.1:{admin}/readyz", timeout=5)
            assert ready.status_code == 503 and ready.json()["checks"]["inference_pool"] is False
            again = httpx.post(url + "/v1/completions", json={"prompt": "x"}, timeout=5)
            assert NOT_STARTED in again.text  # still pending when the signal comes
            signalled = time.monotonic()
            process.send_signal(signal.SIGTERM)
            code = process.wait(EXIT_WITHIN + 10)
            stopped = time.monotonic() - signalled
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
            log.seek(0)
            output = log.read().decode()[-3000:]
        assert code == 0, output
        assert stopped < EXIT_WITHIN, f"exited {stopped:.1f} s after SIGTERM: {output}"
