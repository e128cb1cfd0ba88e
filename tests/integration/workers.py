"""The sidecar with several workers (``KVR_WORKERS``) in front of a fake D, for the workers' tests.

``FakeDecode`` answers as vLLM D and records the releases its control endpoint gets (``gate`` and
``control_gate`` hold them); ``start_workers`` runs ``kv-release-sidecar`` with two workers in front
of it and ``Workers`` drives them (requests, metrics, the shared table's files).
"""

from __future__ import annotations

import asyncio
import json
import signal
import ssl
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from sidecar.wire import error_body
from tests.support.emulation import EMULATED
from tests.support.ports import free_port
from tests.support.runner import kv_params
from tests.support.until import answered, until

HANG = 300.0 if EMULATED else 60.0  # a bound for a hang, not a measure (emulation: tests.support.emulation)


VALIDATION = error_body(
    "1 validation error:\n  {'type': 'int_parsing', 'loc': ('body', 'max_tokens'), "
    "'msg': 'Input should be a valid integer', 'input': 'x'}",
    400,
    "Bad Request",
    "body.max_tokens",
)


class FakeDecode:
    """D and its control endpoint. A completion's prompt says what D does: ``reject`` (vLLM's
    400 for a body failing validation, before its handler: the sidecar releases), ``hold``
    (answer 200 once ``gate`` opens), ``hold-reject`` (the 400 once ``gate`` opens), else 200."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.control_gate = threading.Event()
        self.control_gate.set()
        self.releases: list[str] = []  # the remote_request_id of every release asked for
        self.completions: list[str] = []
        self.held = 0
        self._lock = threading.Lock()

    def app(self) -> Starlette:
        async def health(request: Request) -> Response:
            return Response(b"")

        async def version(request: Request) -> Response:
            return JSONResponse({"version": "0.33.0"})

        async def completions(request: Request) -> Response:
            body = await request.json()
            rid = body["kv_transfer_params"]["remote_request_id"]
            with self._lock:
                self.completions.append(rid)
            prompt = body["prompt"]
            if prompt.startswith("hold"):
                with self._lock:
                    self.held += 1
                await asyncio.to_thread(self.gate.wait, HANG)
            if prompt.endswith("reject"):
                return Response(VALIDATION, status_code=400, media_type="application/json")
            answer = {"id": "cmpl-1", "object": "text_completion", "created": 0, "model": "m",
                      "choices": [{"index": 0, "text": "ok", "finish_reason": "length"}]}  # fmt: skip
            return JSONResponse(answer)

        async def release(request: Request) -> Response:
            body = await request.json()
            await asyncio.to_thread(self.control_gate.wait, HANG)
            with self._lock:
                self.releases.append(body["kv_transfer_params"]["remote_request_id"])
            return JSONResponse({"request_id": body["request_id"]})

        async def control_health(request: Request) -> Response:
            return JSONResponse({})

        return Starlette(
            routes=[
                Route("/health", health),
                Route("/version", version),
                Route("/v1/completions", completions, methods=["POST"]),
                Route("/kv_release/v1/release", release, methods=["POST"]),
                Route("/kv_release/v1/health", control_health),
            ]
        )


class Workers:
    """A running ``serve --workers 2`` and what its log says."""

    def __init__(self, process: subprocess.Popen[bytes], log: Path, url: str, admin: str) -> None:
        self.process, self.log, self.url, self.admin = process, log, url, admin
        self.verify: ssl.SSLContext | bool = True

    def lines(self) -> list[dict[str, Any]]:
        found = []
        for line in self.log.read_text().splitlines():
            if line.startswith("{"):
                found.append(json.loads(line))
        return found

    def sockets(self) -> dict[int, str]:
        """Each worker's admin socket, by index (the last one logged: a restarted worker's)."""
        found: dict[int, str] = {}
        for line in self.lines():
            if line.get("msg") == "listening" and line.get("setting") == "admin_port":
                found[line["worker"]] = line["addresses"][0]  # each worker's lines name it
        return found

    def ready(self) -> dict[str, Any]:
        response = answered(
            self.admin + "/readyz",
            timeout=HANG,
            poll=0.05,
            process=self.process,
            log=self.log,
            verify=self.verify,
        )
        body: dict[str, Any] = response.json()
        return body

    def worker_sample(self, index: int, name: str, **labels: str) -> float:
        socket = self.sockets()[index]
        with httpx.Client(transport=httpx.HTTPTransport(uds=socket), timeout=5) as client:
            text = client.get("http://worker/metrics").text
        return sample(text, name, **labels)

    def sample(self, name: str, **labels: str) -> float:
        return sample(httpx.get(self.admin + "/metrics", timeout=5).text, name, **labels)

    def complete(self, rid: str, prompt: str = "say ok") -> httpx.Response:
        """One completion over a connection of its own."""
        body = {"model": "m", "prompt": prompt, "max_tokens": 4, "kv_transfer_params": kv_params(rid)}
        return httpx.post(self.url + "/v1/completions", json=body, timeout=HANG)

    def until_each_worker(self, name: str, send: Callable[[int], object], **labels: str) -> int:
        """Call ``send(i)`` (i = 0, 1, ...) until metric ``name`` counts at least one on every worker;
        how many calls that took."""
        for i in range(400):
            send(i)
            if all(self.worker_sample(w, name, **labels) >= 1 for w in (0, 1)):
                return i + 1
        raise AssertionError("the kernel gave every connection to one worker 400 times")


def sample(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


def start_workers(
    decode_url: str, tmp_path: Path, *flags: str, verify: ssl.SSLContext | None = None
) -> Iterator[Workers]:
    port, admin = free_port(), free_port()
    log = tmp_path / "sidecar.log"
    argv = [sys.executable, "-m", "sidecar", "serve", "--workers", "2", "--release", "http",
            "--control-token", "t", "--decode-url", decode_url, "--decode-kv-connector", "yes",
            "--vllm-version", "0.33.0", "--host", "127.0.0.1", "--port", str(port),
            "--admin-host", "127.0.0.1", "--admin-port", str(admin), "--log-format", "json",
            *flags]  # fmt: skip
    with log.open("wb") as out:
        process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    try:
        scheme = "http" if verify is None else "https"
        workers = Workers(process, log, f"{scheme}://127.0.0.1:{port}", f"{scheme}://127.0.0.1:{admin}")
        workers.verify = verify or True
        workers.ready()
        until(
            lambda: len(workers.sockets()) == 2, "both workers' admin sockets logged", timeout=HANG, poll=0.02
        )
        yield workers
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(HANG)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
