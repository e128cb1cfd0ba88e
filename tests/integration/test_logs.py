"""``serve``'s log, as an operator reads it: JSON throughout, each line once, no ANSI escapes.

``python -m sidecar serve`` runs as a child process with ``--release nixl`` (so
NIXL's own Python loggers, which install a text handler of their own when
imported, write too) in front of the D simulator, answers a request, and is
stopped with SIGTERM. Every line on its stderr and stdout must be one JSON
object; uvicorn's start and stop lines appear once although two servers run;
no escape sequence appears; this pod's own SIGTERM is said, never warned
about; the access log is off unless asked, and then one JSON line per request.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest

from sidecar.sim.decode import create_decode_app
from sidecar.sim.decode.config import DecodeSimConfig
from sidecar.sim.servers import ServerThread, serve
from tests.support.ports import free_port
from tests.support.until import answered

pytestmark = pytest.mark.nixl


@pytest.fixture(scope="module")
def d() -> Iterator[ServerThread]:
    with serve(create_decode_app(DecodeSimConfig(port=0))) as server:
        yield server


@contextmanager
def sidecar(d_url: str, *flags: str) -> Iterator[tuple[str, list[dict[str, Any]]]]:
    """The sidecar as a child process; yields its URL, then (after SIGTERM) fills its log lines."""
    port, admin = free_port(), free_port()
    argv = [sys.executable, "-m", "sidecar", "serve", "--decode-url", d_url, "--host", "127.0.0.1"]
    argv += ["--port", str(port), "--admin-host", "127.0.0.1", "--admin-port", str(admin)]
    argv += ["--release", "nixl", "--prefill-allow", "127.0.0.1", "--vllm-version", "0.33.0", *flags]
    env = {**os.environ, "KVR_SHUTDOWN_DELAY": "0", "KVR_DRAIN_TIMEOUT": "2", "KVR_FLUSH_TIMEOUT": "1"}
    child = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)
    lines: list[dict[str, Any]] = []
    try:
        answered(f"http://127.0.0.1:{admin}/readyz", timeout=30, process=child)
        yield f"http://127.0.0.1:{port}", lines
    finally:
        child.send_signal(signal.SIGTERM)
        out, _ = child.communicate(timeout=30)
        lines.extend(_parse(out))


def _parse(out: str) -> list[dict[str, Any]]:
    parsed = []
    for line in out.splitlines():
        try:
            parsed.append(json.loads(line))
        except json.JSONDecodeError:
            parsed.append({"not_json": line})
    return parsed


def test_every_line_is_json_once_without_ansi_and_sigterm_is_no_warning(d: ServerThread) -> None:
    with sidecar(d.url) as (url, lines):
        assert httpx.get(url + "/v1/models").status_code == 200
    assert lines and [line for line in lines if "not_json" in line] == []
    assert not any("\x1b" in json.dumps(line) or "color_message" in line for line in lines)
    messages = [line["msg"] for line in lines if line["logger"] == "uvicorn.error"]
    for lifecycle in ("Started server process", "Shutting down", "Finished server process"):
        assert len([m for m in messages if m.startswith(lifecycle)]) == 1, messages
    assert any(line["logger"].startswith("nixl") for line in lines)  # NIXL's own lines, as JSON
    assert [line for line in lines if line["level"] == "warning" and "shutting down" in line["msg"]] == []
    assert [line for line in lines if line["logger"] == "uvicorn.access"] == []  # off by default


def test_the_access_log_is_one_json_line_per_request(d: ServerThread) -> None:
    with sidecar(d.url, "--access-log") as (url, lines):
        assert httpx.get(url + "/v1/models").status_code == 200
    [access] = [line for line in lines if line["logger"] == "uvicorn.access"]
    assert (access["method"], access["path"], access["status"]) == ("GET", "/v1/models", 200)
