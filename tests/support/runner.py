"""How tests start a sidecar: in this process or as the program users run.

- ``run_sidecar``: the proxy and admin apps on one uvicorn loop in a thread, with a recording
  releaser (``Sidecar`` reads its metrics and waits on its pipeline); ``kv_params`` are P's
  parameters as a client sends them; ``RETRIED`` runs a test under both retried-status settings.
- ``sidecar_process``: ``kv-release-sidecar`` as a child process in front of a decode URL.
- ``guarded_sidecar``: ``run_sidecar`` with short header and body timeouts (hostile clients).
- ``sidecar``: any sidecar command line (llm-d's, KServe's) as a child, until ``ready()`` holds;
  ``answers`` is a readiness check, ``sample``/``wait_sample`` read a child's metrics.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from sidecar.app import Deps, ProxyApp, create_admin_app, create_app
from sidecar.config import Config
from sidecar.release.stub import StubReleaser
from sidecar.release.stub import StubReleaser as DryRunReleaser
from sidecar.server.host import server_options
from sidecar.server.limits import ServerLimits
from sidecar.sim.servers import ServerThread, serve
from tests.support.ports import free_port
from tests.support.until import answered, until


class Recording(StubReleaser):
    """The ``dry-run`` recorder standing in for the configured strategy: the proxy behaves as for
    that strategy (its releases free P's blocks, ``http`` and ``auto`` keep the raw parameters)."""

    def __init__(self, keep: int, frees: bool, keeps_raw: bool) -> None:
        super().__init__("dry-run", keep)
        self.frees, self.checked, self.keeps_raw = frees, frees, keeps_raw  # type: ignore[misc]


class Sidecar:
    """A running sidecar (proxy + admin on one loop) with a recording releaser."""

    def __init__(self, server: ServerThread, app: ProxyApp, releaser: StubReleaser) -> None:
        self.server, self.app, self.releaser = server, app, releaser
        self.url, self.admin_url = server.urls[0], server.urls[1]

    @property
    def registry(self) -> CollectorRegistry:
        assert self.app.runtime is not None
        return self.app.runtime.metrics.registry

    def sample(self, name: str, **labels: str) -> float:
        return self.registry.get_sample_value(name, labels) or 0.0

    def wait_idle(self, timeout: float = 5.0) -> bool:
        """Wait until no request is in flight (each was classified and counted); whether none is."""
        idle = lambda: not self.sample("kvr_inflight_requests")  # noqa: E731
        return until(idle, "no request in flight", timeout, 0.002, fail=False)

    def released(self) -> list[str]:
        return [job.params.remote_request_id or job.request_id for job in self.releaser.recorded]

    def wait_released(self, count: int, timeout: float = 5.0) -> list[str]:
        """The released requests' ids once ``count`` were released, or all there are after ``timeout``."""
        until(lambda: len(self.releaser.recorded) >= count, f"{count} releases", timeout, 0.002, fail=False)
        return self.released()

    def settle(self) -> None:
        """Wait until every submitted job finished (the queue is empty and idle)."""
        assert self.app.runtime is not None
        assert self.server.call(self.app.runtime.pipeline.flush(5.0))


#: ``retried_statuses=SHIPPED`` leaves the setting out, so ``Config``'s own default (502, 503, 504)
#: applies, as ``serve`` ships it; ``NONE`` is the value of a deployment nothing in front retries.
SHIPPED = "shipped"


NONE = ("none",)


RETRIED = pytest.mark.parametrize("retried", [SHIPPED, NONE], ids=["retried-default", "retried-none"])


def retried_statuses(settings: dict[str, Any]) -> dict[str, Any]:
    """``settings`` with ``retried_statuses`` as the tests want it: ``NONE`` unless given, and left
    out for ``SHIPPED``."""
    settings = {"retried_statuses": NONE, **settings}
    if settings["retried_statuses"] == SHIPPED:
        del settings["retried_statuses"]
    return settings


@contextmanager
def run_sidecar(decode_url: str, record: bool = False, **settings: Any) -> Iterator[Sidecar]:
    """A sidecar in front of ``decode_url``; ``dry-run`` (recording) unless ``release`` is given.

    ``record``: the recording releaser stands in for the configured strategy (the proxy still
    behaves as configured for it, e.g. keeping raw parameters for ``http``).
    """
    # Tests talk to the sidecar directly: nothing in front retries its answers on another pod
    # (tests/faults/test_mesh_retries.py runs real retrying proxies with the default); the tests
    # whose outcome depends on it run under both values (``RETRIED``).
    settings = retried_statuses({"release": "dry-run", "log_level": "warning", **settings})
    config = Config(decode_url=decode_url, **settings)
    frees, keeps_raw = config.release in ("nixl", "http", "auto"), config.release in ("http", "auto")
    releaser = Recording(keep=100_000, frees=frees, keeps_raw=keeps_raw)
    injected = releaser if record or config.release == "dry-run" else None
    app = create_app(config, Deps(releaser=injected, registry=CollectorRegistry()))
    # The production protocol (sidecar.server.protocol, as sidecar.server.serve runs it) on the proxy port,
    # not the test servers' default h11: what a client meets is what the sidecar ships.
    options = server_options(ServerLimits.of(config))
    with serve(app, create_admin_app(app), server_header=False, date_header=False, **options) as server:
        yield Sidecar(server, app, releaser)


def kv_params(rid: str, **changes: Any) -> dict[str, Any]:
    """``kv_transfer_params`` as P answers them (vLLM 0.13.0+ pull mode, TP 1), with ``changes``."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": "p-engine",
        "remote_request_id": rid,
        "remote_host": "10.0.0.7",
        "remote_port": 5600,
        "remote_block_ids": [[1, 2]],
        "tp_size": 1,
        **changes,
    }


@contextmanager
def sidecar_process(
    decode_url: str, *flags: str, log: Path | None = None, ready: str = "/healthz", timeout: float = 20.0
) -> Iterator[tuple[subprocess.Popen[bytes], str, str]]:
    """``python -m sidecar serve`` in front of ``decode_url`` with ``flags``, once its admin port
    answers ``ready``; the process, its proxy URL and its admin URL. ``log``: where its output goes
    (and whose end a failed start shows); killed on exit if still running."""
    port, admin = free_port(), free_port()
    argv = [sys.executable, "-m", "sidecar", "serve", "--decode-url", decode_url, "--host", "127.0.0.1"]
    argv += ["--port", str(port), "--admin-host", "127.0.0.1", "--admin-port", str(admin), *flags]
    env = {**os.environ, "KVR_LOG_LEVEL": "warning", "PYTHONUNBUFFERED": "1"}
    with contextlib.ExitStack() as stack:
        output = stack.enter_context(log.open("wb")) if log is not None else subprocess.DEVNULL
        proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=output)
        try:
            answered(f"http://127.0.0.1:{admin}{ready}", timeout=timeout, process=proc, log=log)
            yield proc, f"http://127.0.0.1:{port}", f"http://127.0.0.1:{admin}"
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait(10)


STOP_WITHIN = 10.0


# Variables the sidecar reads that the test runner's own environment must not set for it.
FOREIGN = ("KVR_", "SSL_CERT_", "OTEL_")


@contextmanager
def sidecar(
    args: list[str], env: dict[str, str], ready: Any, program: list[str] | None = None
) -> Iterator[subprocess.Popen[bytes]]:
    """``kv-release-sidecar serve <args>`` (the image's entry point; or ``program``), until
    ``ready()`` holds."""
    log = tempfile.TemporaryFile()  # noqa: SIM115 - closed in the finally below
    process = subprocess.Popen(
        [*(program or [sys.executable, "-m", "sidecar", "serve"]), *args],
        env={**{k: v for k, v in os.environ.items() if not k.startswith(FOREIGN)}, **env},
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:

        def started() -> bool:
            if process.poll() is not None:
                log.seek(0)
                raise AssertionError(
                    f"the sidecar exited {process.returncode}: {log.read().decode()[-3000:]}"
                )
            return bool(ready())

        until(started, "the sidecar to be ready", 60.0, 0.05)
        yield process
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            code = process.wait(STOP_WITHIN)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            code = None
        log.seek(0)
        output = log.read().decode()[-3000:]
        log.close()
    # A pod's SIGTERM ends the sidecar within its drain (nothing is in flight here), exit 0.
    assert code == 0, f"the sidecar did not stop within {STOP_WITHIN} s of SIGTERM (exit {code}): {output}"


def answers(url: str, **kwargs: Any) -> bool:
    try:
        return httpx.get(url, timeout=2, **kwargs).status_code == 200
    except httpx.HTTPError:
        return False


def sample(admin: str, name: str, **labels: str) -> float:
    for family in text_string_to_metric_families(httpx.get(admin + "/metrics", timeout=5).text):
        for found in family.samples:
            if found.name == name and found.labels == labels:
                return float(found.value)
    return 0.0


def wait_sample(admin: str, name: str, value: float, **labels: str) -> None:
    seen = lambda: sample(admin, name, **labels)  # noqa: E731
    until(lambda: seen() == value, f"{name}{labels} to be {value}", 30.0, 0.05, state=seen)


HEADER_TIMEOUT = 1.0


BODY_TIMEOUT = 1.0


MAX_HEADER = 16 * 1024


LIMITS = {
    "client_header_timeout": HEADER_TIMEOUT,
    "client_body_timeout": BODY_TIMEOUT,
    "max_header_bytes": MAX_HEADER,
    "timeout_keep_alive": 0.5,
}


@contextmanager
def guarded_sidecar(decode_url: str, **settings: Any) -> Iterator[Sidecar]:
    """Like ``run_sidecar``, served with the production protocol and limits."""
    settings = retried_statuses({**LIMITS, **settings})  # none unless given: nothing in front retries
    config = Config(decode_url=decode_url, release="dry-run", log_level="warning", **settings)
    releaser = DryRunReleaser(keep=1000)
    app = create_app(config, Deps(releaser=releaser, registry=CollectorRegistry()))
    options = server_options(ServerLimits.of(config))
    with serve(app, create_admin_app(app), server_header=False, date_header=False, **options) as server:
        yield Sidecar(server, app, releaser)
