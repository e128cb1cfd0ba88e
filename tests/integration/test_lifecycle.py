"""The ``serve`` process: readiness, metrics, and a bounded, ordered SIGTERM shutdown."""

from __future__ import annotations

import signal
import threading
import time

import httpx

from sidecar.sim.decode.config import DecodeSimConfig
from sidecar.sim.servers import ServerThread
from tests.support.ports import free_port
from tests.support.runner import sidecar_process
from tests.support.until import answered, until

DECODE = DecodeSimConfig(
    port=0, stream_events=20, event_delay=0.05
)  # D for this module (the ``decode`` fixture)


def test_readyz_follows_decode_health(decode: ServerThread) -> None:
    with sidecar_process(decode.url) as (_, url, admin):
        body = answered(admin + "/readyz").json()
        assert body == {"ready": True, "checks": {"draining": False, "decode": True, "releaser": True}}
        assert httpx.get(url + "/health").status_code == 200  # D's own health, through the proxy
        assert "kvr_ready 1.0" in httpx.get(admin + "/metrics").text
    with sidecar_process(f"http://127.0.0.1:{free_port()}") as (_, _url, admin):
        response = answered(admin + "/readyz", status=503)
        assert response.json()["checks"]["decode"] is False
        assert httpx.get(admin + "/healthz").status_code == 200


def test_sigterm_drops_readiness_drains_streams_and_exits(decode: ServerThread) -> None:
    with sidecar_process(decode.url, "--shutdown-delay", "0.5", "--drain-timeout", "10") as (
        proc,
        url,
        admin,
    ):
        answered(admin + "/readyz")
        chunks: list[bytes] = []
        started = threading.Event()

        def stream() -> None:
            body = {"model": "sim-model", "prompt": "hello", "stream": True}
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=20) as response:
                for chunk in response.iter_raw():
                    chunks.append(chunk)
                    started.set()

        reader = threading.Thread(target=stream)
        reader.start()
        assert started.wait(10)
        began = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        # readiness drops first, while the proxy still serves
        assert answered(admin + "/readyz", status=503, timeout=5).json()["checks"]["draining"] is True
        reader.join(20)
        assert b"".join(chunks).rstrip().endswith(b"data: [DONE]")  # the in-flight stream completed
        assert proc.wait(20) == 0
        assert time.monotonic() - began < 15


def test_a_request_still_running_past_the_drain_gets_a_vllm_shaped_503(decode: ServerThread) -> None:
    # uvicorn cancels what still runs after drain_timeout; the client gets vLLM's error shape,
    # not uvicorn's plain-text 500.
    with sidecar_process(decode.url, "--shutdown-delay", "0", "--drain-timeout", "0.5") as (proc, url, admin):
        answered(admin + "/readyz")
        answers: list[httpx.Response] = []

        def hang() -> None:
            body = {"model": "sim-model", "prompt": "hello [[hang]]", "max_tokens": 2}
            answers.append(
                httpx.post(url + "/v1/completions", json=body, headers={"x-request-id": "h-1"}, timeout=20)
            )

        client = threading.Thread(target=hang)
        client.start()
        until(
            lambda: "kvr_inflight_requests 1.0" in httpx.get(admin + "/metrics").text, "the request in flight"
        )
        proc.send_signal(signal.SIGTERM)
        client.join(20)
        assert proc.wait(20) == 0
    [answer] = answers
    assert answer.status_code == 503
    assert answer.json()["error"]["type"] == "ServiceUnavailableError"
    assert answer.headers["x-request-id"] == "h-1"
