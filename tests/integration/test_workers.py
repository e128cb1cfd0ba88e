"""``serve --workers 2``: every guarantee of one sidecar holds across its worker processes.

Real processes on loopback: ``python -m sidecar serve --workers 2 --release http``
(a supervisor and two workers sharing the proxy port's listening socket) in front
of a fake D run here, which also serves D's control endpoint and records every
release it is asked for. Which worker takes a connection is the kernel's choice,
so each test sends over fresh connections until every worker has had its share,
reading each worker's own ``/metrics`` on its Unix socket (named in its log).
Readiness is polled; no wall-clock bound is asserted beyond a generous one for a hang.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import ssl
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from sidecar.sim.servers import ServerThread
from tests.integration.workers import HANG, FakeDecode, Workers, start_workers
from tests.support.ports import free_port
from tests.support.runner import kv_params
from tests.support.until import until

pytestmark = pytest.mark.serial  # several processes each: run alone, as the other process tests


def test_a_replay_is_refused_on_every_worker(
    fake_decode: tuple[FakeDecode, ServerThread], workers: Workers
) -> None:
    fake = fake_decode[0]
    assert workers.complete("spent-1", "reject").status_code == 400
    until(lambda: fake.releases == ["spent-1"], "the rejection released", timeout=HANG, poll=0.02)
    answers: list[int] = []
    sent = workers.until_each_worker(
        "kvr_released_replays_total",
        lambda i: answers.append(workers.complete("spent-1").status_code),
        action="refused",
    )
    assert answers == [409] * sent  # refused whichever worker took the connection
    assert fake.completions == ["spent-1"]  # no replay reached D
    assert workers.sample("kvr_released_replays_total", action="refused") == sent
    assert fake.releases == ["spent-1"]


def test_exactly_one_release_per_rejection(
    fake_decode: tuple[FakeDecode, ServerThread], workers: Workers
) -> None:
    """Three copies of each rejected request at once, on connections of their own: whichever
    workers judge them, P's blocks are released once."""
    fake = fake_decode[0]
    rids = [f"dup-{i}" for i in range(20)]
    with ThreadPoolExecutor(12) as pool:
        statuses = list(pool.map(lambda rid: workers.complete(rid, "reject").status_code, rids * 3))
    assert set(statuses) <= {400, 409}  # D's rejection, or the replay refused once released
    until(
        lambda: workers.sample("kvr_inflight_requests") == 0, "every request judged", timeout=HANG, poll=0.02
    )
    for worker in (0, 1):
        assert workers.worker_sample(worker, "kvr_release_queue_depth") == 0
    until(lambda: len(fake.releases) >= len(rids), "every rejection released", timeout=HANG, poll=0.02)
    assert sorted(fake.releases) == sorted(rids)  # once each, never twice
    assert workers.sample("kvr_releases_total", result="sent") == len(rids)
    assert all(workers.worker_sample(w, "kvr_requests_total") > 0 for w in (0, 1))


def test_metrics_totals_are_the_sum_of_every_workers_work(
    fake_decode: tuple[FakeDecode, ServerThread], workers: Workers
) -> None:
    def answered(i: int) -> None:
        assert workers.complete(f"ok-{i}").status_code == 200

    sent = workers.until_each_worker("kvr_requests_total", answered, status_class="2xx")
    sent += 10
    for i in range(10):
        answered(1000 + i)
    per_worker = [workers.worker_sample(w, "kvr_requests_total", status_class="2xx") for w in (0, 1)]
    assert sum(per_worker) == sent and min(per_worker) >= 1
    assert workers.sample("kvr_requests_total", status_class="2xx") == sent
    latency = [workers.worker_sample(w, "kvr_upstream_latency_seconds_count") for w in (0, 1)]
    assert workers.sample("kvr_upstream_latency_seconds_count") == sum(latency) == sent
    assert workers.sample("kvr_ready") == 1


@pytest.fixture
def patient(fake_decode: tuple[FakeDecode, ServerThread], tmp_path: Path) -> Iterator[Workers]:
    """Workers whose drain, flush and release held at the control endpoint wait long enough for a
    loaded machine (the test bounds the wait): one attempt, never timed out and retried."""
    flags = ("--drain-timeout", "120", "--flush-timeout", "60", "--control-timeout", "60")
    yield from start_workers(fake_decode[1].url, tmp_path, *flags)


def test_sigterm_drains_every_worker_and_flushes_pending_releases(
    fake_decode: tuple[FakeDecode, ServerThread], patient: Workers
) -> None:
    fake, workers = fake_decode[0], patient
    fake.control_gate.clear()  # the release waits at D's control endpoint: pending at SIGTERM
    assert workers.complete("flushed", "reject").status_code == 400
    results: list[int] = []
    threads: list[threading.Thread] = []

    def hold(i: int) -> None:
        thread = threading.Thread(
            target=lambda: results.append(workers.complete(f"held-{i}", "hold").status_code)
        )
        thread.start()
        threads.append(thread)
        until(lambda: fake.held == len(threads), "the request held at D", timeout=HANG, poll=0.02)

    workers.until_each_worker("kvr_inflight_requests", hold)  # every worker has a request at D
    workers.process.send_signal(signal.SIGTERM)
    until(
        lambda: httpx.get(workers.admin + "/readyz", timeout=5).status_code == 503,
        "readiness off",
        timeout=HANG,
        poll=0.02,
    )
    until(
        lambda: _refused(workers.url),
        "new connections refused while the workers drain",
        timeout=HANG,
        poll=0.02,
    )
    fake.gate.set()
    for thread in threads:
        thread.join(HANG)
    assert results == [200] * len(threads)  # drained: each answered in full
    fake.control_gate.set()
    assert workers.process.wait(HANG) == 0
    assert fake.releases == ["flushed"]  # flushed before the worker exited
    stopped = [line for line in workers.lines() if line.get("msg") == "sidecar stopped"]
    assert [line["releases_flushed"] for line in stopped] == [True, True]


@pytest.fixture
def leased(fake_decode: tuple[FakeDecode, ServerThread], tmp_path: Path) -> Iterator[Workers]:
    """Workers whose release deadline (the veto's hold on a dead worker's requests) outlasts a
    worker's restart on a loaded machine."""
    yield from start_workers(fake_decode[1].url, tmp_path, "--release-deadline", "300")


def test_a_killed_worker_is_restarted_and_nothing_is_released_for_its_requests(
    fake_decode: tuple[FakeDecode, ServerThread], leased: Workers
) -> None:
    fake, workers = fake_decode[0], leased
    before = {w["worker"]: w["pid"] for w in workers.ready()["workers"]}
    client = threading.Thread(target=lambda: _swallow(lambda: workers.complete("orphan", "hold-reject")))
    client.start()
    until(lambda: fake.held == 1, "the request at D", timeout=HANG, poll=0.02)
    victim = next(w for w in (0, 1) if workers.worker_sample(w, "kvr_inflight_requests") == 1)
    os.kill(before[victim], signal.SIGKILL)
    client.join(HANG)  # its client saw the connection drop
    until(
        lambda: any(line.get("msg", "").startswith("worker exited") for line in workers.lines()),
        "the death logged",
        timeout=HANG,
        poll=0.02,
    )
    after = {w["worker"]: w["pid"] for w in workers.ready()["workers"]}
    assert after[victim] != before[victim] and after[1 - victim] == before[1 - victim]
    exited = next(line for line in workers.lines() if line.get("msg", "").startswith("worker exited"))
    assert exited["worker"] == victim and exited["returncode"] == -signal.SIGKILL and exited["vetoed"] == 1
    assert workers.sample("kvr_worker_restarts_total", worker=str(victim)) == 1
    assert workers.sample("kvr_workers") == 2
    fake.gate.set()  # D now rejects the orphan: no worker is left to judge it
    # The same parameters again, rejected at once: D may still be reading them for the dead
    # worker's request (it aborts it), so whichever worker judges this one must not release.
    assert workers.complete("orphan", "reject").status_code == 400
    until(
        lambda: workers.sample("kvr_not_released_total", cause="params_in_use") >= 1,
        "the replay judged",
        timeout=HANG,
        poll=0.02,
    )
    assert workers.sample("kvr_not_released_total") == 1
    assert fake.releases == []


def _refused(url: str) -> bool:
    """A new connection to ``url``'s port is refused (no listener left), rather than queued."""
    port = int(url.rsplit(":", 1)[1])
    try:
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
    except ConnectionRefusedError:
        return True
    return False


def _swallow(call: Callable[[], Any]) -> None:
    with contextlib.suppress(httpx.HTTPError):
        call()


def test_tls_is_served_by_every_worker_and_the_admin_port(
    fake_decode: tuple[FakeDecode, ServerThread], tmp_path: Path
) -> None:
    trustme = pytest.importorskip("trustme")
    ca = trustme.CA()
    issued = ca.issue_cert("127.0.0.1")
    certs = tmp_path / "certs"
    certs.mkdir()
    (certs / "tls.crt").write_bytes(b"".join(blob.bytes() for blob in issued.cert_chain_pems))
    (certs / "tls.key").write_bytes(issued.private_key_pem.bytes())
    ca_file = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    verify = ssl.create_default_context(cafile=str(ca_file))
    flags = ("--tls", "--tls-cert-dir", str(certs), "--admin-tls-cert-dir", str(certs))
    with contextlib.contextmanager(start_workers)(
        fake_decode[1].url, tmp_path, *flags, verify=verify
    ) as workers:
        answered: list[int] = []

        def ask(i: int) -> None:
            body = {"model": "m", "prompt": "ok", "max_tokens": 4, "kv_transfer_params": kv_params(f"t{i}")}
            response = httpx.post(workers.url + "/v1/completions", json=body, timeout=HANG, verify=verify)
            answered.append(response.status_code)

        sent = workers.until_each_worker("kvr_requests_total", ask, status_class="2xx")
        assert answered == [200] * sent  # each worker served TLS with the directory's certificate
        assert httpx.get(workers.admin + "/readyz", timeout=5, verify=verify).status_code == 200
        workers.process.send_signal(signal.SIGTERM)
        assert workers.process.wait(HANG) == 0


def test_workers_that_cannot_start_stop_the_supervisor_with_their_status(
    fake_decode: tuple[FakeDecode, ServerThread], tmp_path: Path
) -> None:
    """As one process exits 1 when its start-up fails, so do the workers' supervisor, at once."""
    argv = [sys.executable, "-m", "sidecar", "serve", "--workers", "2", "--release", "http",
            "--control-token-file", str(tmp_path / "missing"), "--decode-url", fake_decode[1].url,
            "--host", "127.0.0.1", "--port", str(free_port()), "--admin-host", "127.0.0.1",
            "--admin-port", str(free_port()), "--log-format", "json"]  # fmt: skip
    result = subprocess.run(argv, capture_output=True, timeout=HANG, check=False)
    assert result.returncode == 1, result.stderr[-2000:]
    lines = [json.loads(line) for line in result.stderr.decode().splitlines() if line.startswith("{")]
    assert any(line["msg"] == "worker failed to start" for line in lines)
