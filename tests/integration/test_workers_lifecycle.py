"""``serve --workers 2`` across changes: a rotated certificate, a supervisor killed with SIGKILL.

Real processes on loopback, as in ``test_workers`` (whose fake D and helpers
these tests use): a supervisor, two workers on the inherited listening socket,
a fake D. Which worker served a connection is read from the workers' own
``/metrics`` (each on its Unix socket) around one request at a time.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import socket
import ssl
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import trustme
from cryptography import x509

from sidecar.sim.servers import ServerThread
from tests.integration.workers import HANG, FakeDecode, Workers, start_workers
from tests.support.runner import kv_params
from tests.support.until import until

pytestmark = pytest.mark.serial  # several processes each: run alone, as the other process tests


def served_by(workers: Workers, send: Callable[[], Any]) -> tuple[int, Any]:
    """``send()`` one completion; the worker that served it (its ``kvr_requests_total`` rose), and
    what ``send`` returned."""
    before = [workers.worker_sample(w, "kvr_requests_total") for w in (0, 1)]
    result = send()
    after = [workers.worker_sample(w, "kvr_requests_total") for w in (0, 1)]
    rose = [w for w in (0, 1) if after[w] > before[w]]
    assert len(rose) == 1 and after[rose[0]] == before[rose[0]] + 1, (before, after)
    return rose[0], result


def write_cert(ca: Any, directory: Path) -> int:
    """A new tls.crt and tls.key, each replaced by a rename as a Secret's update is; its serial."""
    issued = ca.issue_cert("127.0.0.1")
    for name, blob in (("tls.crt", issued.cert_chain_pems[0]), ("tls.key", issued.private_key_pem)):
        blob.write_to_path(str(directory / f".{name}"))
        os.replace(directory / f".{name}", directory / name)
    return int(x509.load_pem_x509_certificate(issued.cert_chain_pems[0].bytes()).serial_number)


def tls_completion(port: int, verify: ssl.SSLContext, rid: str) -> tuple[int, int]:
    """One completion over a new TLS connection: (the served certificate's serial, the status)."""
    connection = http.client.HTTPSConnection("127.0.0.1", port, context=verify, timeout=HANG)
    try:
        connection.connect()
        assert isinstance(connection.sock, ssl.SSLSocket)
        der = connection.sock.getpeercert(binary_form=True)
        assert der is not None
        body = {"model": "m", "prompt": "say ok", "max_tokens": 4, "kv_transfer_params": kv_params(rid)}
        headers = {"content-type": "application/json"}
        connection.request("POST", "/v1/completions", json.dumps(body), headers)
        status = connection.getresponse().status
    finally:
        connection.close()
    return x509.load_der_x509_certificate(der).serial_number, status


def test_a_rotated_certificate_reaches_new_connections_on_every_worker(
    fake_decode: tuple[FakeDecode, ServerThread], tmp_path: Path
) -> None:
    ca = trustme.CA()
    certs = tmp_path / "certs"
    certs.mkdir()
    first = write_cert(ca, certs)
    ca_file = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    verify = ssl.create_default_context(cafile=str(ca_file))
    flags = ("--tls", "--tls-cert-dir", str(certs), "--admin-tls-cert-dir", str(certs))
    with contextlib.contextmanager(start_workers)(
        fake_decode[1].url, tmp_path, *flags, verify=verify
    ) as workers:
        port, started = int(workers.url.rsplit(":", 1)[1]), pids(workers)
        calls = iter(range(10_000))

        def each_worker_serves(serial: int) -> None:
            served: dict[int, list[tuple[int, int]]] = {0: [], 1: []}
            for _ in range(400):
                worker, answer = served_by(workers, lambda: tls_completion(port, verify, f"r{next(calls)}"))
                served[worker].append(answer)
                if served[0] and served[1]:
                    break
            assert served[0] and served[1], "the kernel gave every connection to one worker 400 times"
            assert {a for answers in served.values() for a in answers} == {(serial, 200)}, served

        each_worker_serves(first)
        second = write_cert(ca, certs)  # the Secret's new version
        assert second != first

        def reloaded() -> set[int]:
            # The supervisor, which serves the admin port, logs the same line without a worker index.
            lines = workers.lines()
            return {
                line["worker"]
                for line in lines
                if line.get("msg") == "TLS certificate reloaded" and "worker" in line
            }

        until(lambda: reloaded() == {0, 1}, "every worker reloaded its certificate", timeout=HANG, poll=0.02)
        each_worker_serves(second)  # every new connection, whichever worker takes it: no restart
        assert pids(workers) == started  # no worker restarted for it
        admin = int(workers.admin.rsplit(":", 1)[1])
        until(
            lambda: serial_at(admin, verify) == second,
            "the admin port's certificate reloaded",
            timeout=HANG,
            poll=0.02,
        )


def pids(workers: Workers) -> dict[int, int]:
    return {w["worker"]: w["pid"] for w in workers.ready()["workers"]}


def serial_at(port: int, verify: ssl.SSLContext) -> int:
    """The serial of the certificate a new TLS connection to ``port`` is served."""
    with (
        socket.create_connection(("127.0.0.1", port), timeout=HANG) as raw,
        verify.wrap_socket(raw, server_hostname="127.0.0.1") as tls,
    ):
        der = tls.getpeercert(binary_form=True)
    assert der is not None
    return int(x509.load_der_x509_certificate(der).serial_number)


def directory_of(workers: Workers) -> Path:
    """The supervisor's private directory (shared table, admin sockets), as it logged it."""
    until(
        lambda: any(line.get("msg") == "workers started" for line in workers.lines()),
        "started",
        timeout=HANG,
        poll=0.02,
    )
    started = next(line for line in workers.lines() if line.get("msg") == "workers started")
    return Path(started["directory"])


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_a_supervisor_killed_with_sigkill_leaves_a_directory_the_next_one_removes(
    fake_decode: tuple[FakeDecode, ServerThread], tmp_path: Path
) -> None:
    url = fake_decode[1].url
    start = contextlib.contextmanager(start_workers)
    for name in ("live", "killed", "next"):
        (tmp_path / name).mkdir()
    with start(url, tmp_path / "live") as live, start(url, tmp_path / "killed") as killed:
        kept, left = directory_of(live), directory_of(killed)
        orphans = list(pids(killed).values())
        os.kill(killed.process.pid, signal.SIGKILL)
        killed.process.wait()
        assert left.is_dir() and (left / "ledger").is_file()  # what nothing else would remove
        until(
            lambda: all(gone(pid) for pid in orphans),
            "its workers exited (SIGTERM at its death)",
            timeout=HANG,
            poll=0.02,
        )
        with start(url, tmp_path / "next") as following:
            assert not left.exists()  # removed at the next supervisor's start
            assert kept.is_dir() and (kept / "ledger").is_file()  # a live one's is never touched
            assert live.complete("still-served").status_code == 200
            mine = directory_of(following)
            # Removed by this supervisor, unless one another test started meanwhile swept it first.
            sweeps = [line for line in following.lines() if line["msg"].startswith("removed directories")]
            assert str(kept) not in {path for line in sweeps for path in line["paths"]}
        assert not mine.exists()  # and a supervisor stopped by SIGTERM removes its own
