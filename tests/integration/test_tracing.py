"""OpenTelemetry tracing (sidecar.observability): spans, W3C propagation on both legs, off means untouched.

Real uvicorn servers on loopback. D and P are either tiny recording ASGI apps
(they keep every request's headers) or the simulators with real NIXL. Spans
go to an ``InMemorySpanExporter`` injected through ``Deps.tracing``, except in
the one test that exports over real OTLP/HTTP to a local receiver.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from prometheus_client import CollectorRegistry

from sidecar.app import Deps, create_admin_app, create_app
from sidecar.config import Config, load
from sidecar.observability.tracing import build
from sidecar.release.base import JobResult, ReleaseJob, RetryableReleaseError
from sidecar.release.stub import StubReleaser as DryRunReleaser
from sidecar.sim.servers import ServerThread, serve
from tests.support.ports import free_port
from tests.support.runner import Sidecar, answers, kv_params, sidecar
from tests.support.until import until

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{CLIENT_SPAN}-01"
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

Handler = Callable[[str, bytes], tuple[int, bytes]]


class Recorder:
    """A raw ASGI server that keeps each request's path and headers and answers via ``handler``."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.requests: list[tuple[str, list[tuple[str, str]]]] = []

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (message := await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        headers = [(n.decode("latin-1"), v.decode("latin-1")) for n, v in scope["headers"]]
        self.requests.append((scope["path"], headers))
        status, answer = self.handler(scope["path"], body)
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [(b"content-type", b"application/json")],
            }
        )
        await send({"type": "http.response.body", "body": answer})

    def header(self, index: int, name: str) -> list[str]:
        return [v for n, v in self.requests[index][1] if n == name]


def answer_ok(path: str, body: bytes) -> tuple[int, bytes]:
    return 200, b'{"id":"cmpl-1","choices":[{"text":"hi"}]}'


def answer_reject(path: str, body: bytes) -> tuple[int, bytes]:
    return 503, b'{"error":{"message":"overloaded","type":"ServiceUnavailable","code":503}}'


def answer_prefill(path: str, body: bytes) -> tuple[int, bytes]:
    params = {**kv_params("r-p"), "remote_request_id": "p-req-1"}
    return 200, json.dumps({"kv_transfer_params": params, "usage": {"prompt_tokens": 3}}).encode()


def completion(**extra: Any) -> dict[str, Any]:
    return {"model": "m", "prompt": "hello", "max_tokens": 4, **extra}


@contextmanager
def traced_sidecar(
    decode_url: str, exporter: InMemorySpanExporter | None = None, releaser: Any = None, **settings: Any
) -> Iterator[Sidecar]:
    """``run_sidecar`` with tracing: spans to ``exporter``, or as the config says when None."""
    settings = {
        "release": "dry-run",
        "log_level": "warning",
        "retried_statuses": ("none",),
        "decode_health_interval": 0,  # D's recorded requests are the traced ones, no /health polls
        **settings,
    }
    config = Config(decode_url=decode_url, **settings)
    dry = DryRunReleaser(keep=1000)
    injected = releaser or (dry if config.release == "dry-run" else None)
    tracing = build(config, exporter) if exporter is not None else None
    app = create_app(config, Deps(releaser=injected, registry=CollectorRegistry(), tracing=tracing))
    with serve(app, create_admin_app(app), server_header=False, date_header=False) as server:
        yield Sidecar(server, app, dry)


@contextmanager
def recorder(handler: Handler) -> Iterator[tuple[Recorder, ServerThread]]:
    app = Recorder(handler)
    with serve(app) as server:
        yield app, server


def wait_spans(exporter: InMemorySpanExporter, *names: str, timeout: float = 5.0) -> dict[str, ReadableSpan]:
    """The finished spans by name once every name in ``names`` ended (one span per name)."""

    def ended() -> dict[str, ReadableSpan] | None:
        found = {s.name: s for s in exporter.get_finished_spans()}
        return found if all(n in found for n in names) else None

    have = lambda: [s.name for s in exporter.get_finished_spans()]  # noqa: E731
    found = until(ended, f"spans {names} to end", timeout, 0.005, state=have)
    assert found is not None
    return found


def hexid(value: int, width: int = 16) -> str:
    return format(value, f"0{width}x")


def traceparent_parts(value: str) -> tuple[str, str, str]:
    version, trace_id, parent, flags = value.split("-")
    assert version == "00"
    return trace_id, parent, flags


def test_sidecar_mode_proxy_and_decode_spans_continue_the_clients_trace() -> None:
    exporter = InMemorySpanExporter()
    with recorder(answer_ok) as (d, d_server), traced_sidecar(d_server.url, exporter) as sc:
        headers = {"traceparent": TRACEPARENT, "tracestate": "vendor=abc", "x-request-id": "req-1"}
        response = httpx.post(sc.url + "/v1/completions", json=completion(), headers=headers)
        assert response.status_code == 200
        spans = wait_spans(exporter, "kvr.proxy", "kvr.decode")
    proxy, decode = spans["kvr.proxy"], spans["kvr.decode"]
    assert proxy.kind is SpanKind.SERVER and decode.kind is SpanKind.CLIENT
    assert hexid(proxy.context.trace_id, 32) == TRACE_ID
    assert proxy.parent is not None and hexid(proxy.parent.span_id) == CLIENT_SPAN
    assert decode.parent is not None and decode.parent.span_id == proxy.context.span_id
    assert decode.context.trace_id == proxy.context.trace_id
    # D got one traceparent: the client's trace, the kvr.decode span as parent; tracestate kept.
    [sent] = d.header(0, "traceparent")
    trace_id, parent, flags = traceparent_parts(sent)
    assert (trace_id, parent, flags) == (TRACE_ID, hexid(decode.context.span_id), "01")
    assert d.header(0, "tracestate") == ["vendor=abc"]
    assert d.header(0, "x-request-id") == ["req-1"]
    attrs = dict(proxy.attributes or {})
    assert attrs["http.request.method"] == "POST" and attrs["url.path"] == "/v1/completions"
    assert attrs["http.response.status_code"] == 200 and attrs["kvr.request_id"] == "req-1"
    assert (attrs["kvr.outcome"], attrs["kvr.cause"], attrs["kvr.release_decision"]) == (
        "no_release",
        "admitted",
        "no_params",
    )
    decode_attrs = dict(decode.attributes or {})
    assert decode_attrs["http.response.status_code"] == 200
    assert decode_attrs["server.address"] == "127.0.0.1" and decode_attrs["server.port"] == d_server.port
    assert decode_attrs["url.full"] == d_server.url + "/v1/completions"
    assert proxy.status.status_code is StatusCode.UNSET and decode.status.status_code is StatusCode.UNSET


def test_passthrough_routes_are_not_traced_and_keep_their_headers() -> None:
    exporter = InMemorySpanExporter()
    with recorder(answer_ok) as (d, d_server), traced_sidecar(d_server.url, exporter) as sc:
        response = httpx.get(sc.url + "/v1/models", headers={"traceparent": TRACEPARENT})
        assert response.status_code == 200
    assert exporter.get_finished_spans() == ()
    assert d.header(0, "traceparent") == [TRACEPARENT]


def test_rejection_gives_a_release_span_in_the_request_trace() -> None:
    exporter = InMemorySpanExporter()
    with recorder(answer_reject) as (_d, d_server), traced_sidecar(d_server.url, exporter) as sc:
        body = completion(kv_transfer_params=kv_params("rel-1"))
        response = httpx.post(sc.url + "/v1/completions", json=body, headers={"traceparent": TRACEPARENT})
        assert response.status_code == 503
        assert sc.wait_released(1) == ["rel-1"]
        sc.settle()
        spans = wait_spans(exporter, "kvr.proxy", "kvr.decode", "kvr.release")
    proxy, decode, release = spans["kvr.proxy"], spans["kvr.decode"], spans["kvr.release"]
    assert release.context.trace_id == proxy.context.trace_id
    assert hexid(release.context.trace_id, 32) == TRACE_ID
    assert release.parent is not None and release.parent.span_id == proxy.context.span_id
    attrs = dict(release.attributes or {})
    assert attrs["kvr.release.strategy"] == "dry-run" and attrs["kvr.release.cause"] == "rejected_5xx"
    assert attrs["kvr.release.result"] == "dry_run" and attrs["kvr.release.attempts"] == 1
    assert attrs["kvr.remote_request_id"] == "rel-1"
    proxy_attrs = dict(proxy.attributes or {})
    assert proxy_attrs["kvr.release_decision"] == "queued" and proxy_attrs["kvr.cause"] == "rejected_5xx"
    assert proxy.status.status_code is StatusCode.ERROR  # a 5xx answer to the client
    assert decode.status.status_code is StatusCode.ERROR
    assert dict(decode.attributes or {})["error.type"] == "503"


class FlakyReleaser:
    """Fails the first attempt of each job (retryable), then succeeds."""

    name = "flaky"
    frees = True
    checked = True
    keeps_raw = False

    def detail(self) -> dict[str, object]:
        return {}

    def __init__(self) -> None:
        self.calls = 0

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None

    def ready(self) -> bool:
        return True

    def target(self, job: ReleaseJob) -> str:
        return "p"

    async def release(self, job: ReleaseJob) -> JobResult:
        self.calls += 1
        if self.calls == 1:
            raise RetryableReleaseError("P unreachable (test)")
        return JobResult.SENT


def test_release_span_counts_attempts_and_records_failed_ones() -> None:
    exporter = InMemorySpanExporter()
    with (
        recorder(answer_reject) as (_d, d_server),
        traced_sidecar(
            d_server.url,
            exporter,
            releaser=FlakyReleaser(),
            release_retry_initial=0.01,
            release_retry_max=0.02,
        ) as sc,
    ):
        body = completion(kv_transfer_params=kv_params("rel-2"))
        assert httpx.post(sc.url + "/v1/completions", json=body).status_code == 503
        sc.settle()
        release = wait_spans(exporter, "kvr.release")["kvr.release"]
    attrs = dict(release.attributes or {})
    assert attrs["kvr.release.attempts"] == 2 and attrs["kvr.release.result"] == "sent"
    assert [(e.name, dict(e.attributes or {})) for e in release.events] == [
        ("kvr.release.attempt_failed", {"kvr.release.reason": "retryable"})
    ]
    assert release.status.status_code is StatusCode.UNSET


def test_unreachable_d_is_an_error_on_the_decode_span() -> None:
    exporter = InMemorySpanExporter()
    with traced_sidecar(f"http://127.0.0.1:{free_port()}", exporter) as sc:
        body = completion(kv_transfer_params=kv_params("rel-3"))
        assert httpx.post(sc.url + "/v1/completions", json=body).status_code == 503
        sc.settle()
        spans = wait_spans(exporter, "kvr.proxy", "kvr.decode", "kvr.release")
    decode = spans["kvr.decode"]
    assert decode.status.status_code is StatusCode.ERROR
    assert dict(decode.attributes or {})["error.type"] == "connect_refused"
    assert "http.response.status_code" not in (decode.attributes or {})
    assert dict(spans["kvr.release"].attributes or {})["kvr.release.cause"] == "unreachable"


def test_router_mode_traces_both_legs_in_one_trace() -> None:
    exporter = InMemorySpanExporter()
    with (
        recorder(answer_prefill) as (p, p_server),
        recorder(answer_ok) as (d, d_server),
        traced_sidecar(d_server.url, exporter, prefill=(p_server.url,), release="off") as sc,
    ):
        # The client sends no traceparent: the sidecar starts the trace; a stray one is replaced.
        response = httpx.post(sc.url + "/v1/completions", json=completion())
        assert response.status_code == 200
        spans = wait_spans(exporter, "kvr.proxy", "kvr.prefill", "kvr.decode")
    proxy, prefill, decode = spans["kvr.proxy"], spans["kvr.prefill"], spans["kvr.decode"]
    assert proxy.parent is None
    for leg, server in ((prefill, p), (decode, d)):
        assert leg.kind is SpanKind.CLIENT
        assert leg.parent is not None and leg.parent.span_id == proxy.context.span_id
        [sent] = server.header(0, "traceparent")
        trace_id, parent, _ = traceparent_parts(sent)
        assert trace_id == hexid(proxy.context.trace_id, 32)
        assert parent == hexid(leg.context.span_id)
    assert dict(prefill.attributes or {})["http.response.status_code"] == 200
    assert dict(prefill.attributes or {})["server.port"] == p_server.port
    # D got P's parameters (the router leg), under the sidecar's trace.
    assert dict(proxy.attributes or {})["kvr.release_decision"] in ("not_released", "no_params")


def test_router_mode_replaces_the_clients_traceparent_on_both_legs() -> None:
    exporter = InMemorySpanExporter()
    with (
        recorder(answer_prefill) as (p, p_server),
        recorder(answer_ok) as (d, d_server),
        traced_sidecar(d_server.url, exporter, prefill=(p_server.url,), release="off") as sc,
    ):
        headers = {"traceparent": TRACEPARENT}
        assert httpx.post(sc.url + "/v1/completions", json=completion(), headers=headers).status_code == 200
        spans = wait_spans(exporter, "kvr.proxy", "kvr.prefill", "kvr.decode")
    for server, leg in ((p, spans["kvr.prefill"]), (d, spans["kvr.decode"])):
        [sent] = server.header(0, "traceparent")
        assert traceparent_parts(sent) == (TRACE_ID, hexid(leg.context.span_id), "01")


def test_tracing_off_forwards_headers_unchanged() -> None:
    with recorder(answer_ok) as (d, d_server), traced_sidecar(d_server.url) as sc:
        assert sc.app.runtime is not None and not sc.app.runtime.tracing.enabled
        sent = {"traceparent": TRACEPARENT, "tracestate": "vendor=abc", "x-request-id": "off-1"}
        body = json.dumps(completion()).encode()
        response = httpx.post(sc.url + "/v1/completions", content=body, headers=sent)
        assert response.status_code == 200
        assert httpx.post(sc.url + "/v1/completions", json=completion()).status_code == 200
    received = dict(d.requests[0][1])
    assert {k: received[k] for k in sent} == sent
    assert len(d.requests[0][1]) == len(dict(d.requests[0][1]))  # no header added twice
    assert d.header(1, "traceparent") == [] and d.header(1, "tracestate") == []


def test_sample_ratio_zero_exports_nothing_but_still_forwards() -> None:
    exporter = InMemorySpanExporter()
    with (
        recorder(answer_reject) as (d, d_server),
        traced_sidecar(d_server.url, exporter, trace_sample_ratio=0.0) as sc,
    ):
        body = completion(kv_transfer_params=kv_params("rel-4"))
        assert httpx.post(sc.url + "/v1/completions", json=body).status_code == 503
        assert sc.wait_released(1) == ["rel-4"]
        sc.settle()
        # A sampled parent is honoured (parent-based): this trace is recorded.
        headers = {"traceparent": TRACEPARENT}
        assert httpx.post(sc.url + "/v1/completions", json=completion(), headers=headers).status_code == 503
        spans = wait_spans(exporter, "kvr.proxy", "kvr.decode")
    assert all(hexid(s.context.trace_id, 32) == TRACE_ID for s in exporter.get_finished_spans())
    assert {s.name for s in exporter.get_finished_spans()} == {"kvr.proxy", "kvr.decode"}
    assert spans["kvr.proxy"].parent is not None
    # The unsampled request still told D not to sample (flag 01 clear) under a fresh trace.
    [unsampled] = d.header(0, "traceparent")
    trace_id, _, flags = traceparent_parts(unsampled)
    assert int(flags, 16) & 1 == 0 and trace_id != TRACE_ID


def test_spans_reach_a_real_otlp_http_receiver_after_the_shutdown_flush() -> None:
    received: list[ExportTraceServiceRequest] = []

    def collect(path: str, body: bytes) -> tuple[int, bytes]:
        if path != "/v1/traces":
            return 404, b""
        request = ExportTraceServiceRequest()
        request.ParseFromString(body)
        received.append(request)
        return 200, b""

    with serve(Recorder(collect)) as collector, recorder(answer_ok) as (_d, d_server):
        # A bare URL: the sidecar adds /v1/traces, as OTEL_EXPORTER_OTLP_ENDPOINT does.
        with traced_sidecar(
            d_server.url, otlp_traces_endpoint=collector.url, trace_service_name="kvr-test"
        ) as sc:
            headers = {"traceparent": TRACEPARENT}
            assert (
                httpx.post(sc.url + "/v1/completions", json=completion(), headers=headers).status_code == 200
            )
        # The sidecar stopped: its lifespan flushed the batch processor.
        names = {
            (span.name, span.trace_id.hex())
            for request in received
            for resource_spans in request.resource_spans
            for scope_spans in resource_spans.scope_spans
            for span in scope_spans.spans
        }
        services = {
            attribute.value.string_value
            for request in received
            for resource_spans in request.resource_spans
            for attribute in resource_spans.resource.attributes
            if attribute.key == "service.name"
        }
    assert names == {("kvr.proxy", TRACE_ID), ("kvr.decode", TRACE_ID)}
    assert services == {"kvr-test"}


def test_otel_service_name_and_resource_attributes_reach_the_exported_resource() -> None:
    # serve reads the OpenTelemetry variables into its config; the resource is built from it.
    environ = {
        "OTEL_SERVICE_NAME": "decode-sidecar",
        "OTEL_RESOURCE_ATTRIBUTES": "k8s.namespace.name=llm,deployment.environment=pre%20prod,service.name=x",
    }
    loaded = load({}, environ)
    exporter = InMemorySpanExporter()
    settings = {n: getattr(loaded, n) for n in ("trace_service_name", "trace_resource_attributes")}
    with recorder(answer_ok) as (_d, d_server), traced_sidecar(d_server.url, exporter, **settings) as sc:
        assert httpx.post(sc.url + "/v1/completions", json=completion()).status_code == 200
        spans = wait_spans(exporter, "kvr.proxy", "kvr.decode")
    resource = dict(spans["kvr.proxy"].resource.attributes)
    assert resource["service.name"] == "decode-sidecar"  # OTEL_SERVICE_NAME wins over the list's
    assert resource["k8s.namespace.name"] == "llm" and resource["deployment.environment"] == "pre prod"
    assert resource["telemetry.sdk.language"] == "python"
    # Without OTEL_SERVICE_NAME, the list's service.name is the name.
    assert (
        load({}, {"OTEL_RESOURCE_ATTRIBUTES": "a=b,service.name=from-list"}).trace_service_name == "from-list"
    )


def test_pd_sidecar_with_tracing_exports_the_otel_resource_over_otlp() -> None:
    # llm-d's --tracing, as its pods set it: OTEL_* variables only (llm-d reads them since v0.10.0).
    received: list[ExportTraceServiceRequest] = []

    def collect(path: str, body: bytes) -> tuple[int, bytes]:
        request = ExportTraceServiceRequest()
        request.ParseFromString(body)
        received.append(request)
        return 200, b""

    with serve(Recorder(collect)) as collector, recorder(answer_ok) as (_d, d_server):
        port, admin = free_port(), free_port()
        args = [f"--port={port}", f"--vllm-port={d_server.port}", "--secure-serving=false", "--tracing"]
        env = {
            "KVR_ADMIN_PORT": str(admin),
            "KVR_PREFILL_ALLOW": "127.0.0.1",
            "KVR_DECODE_HEALTH_INTERVAL": "0",
            "OTEL_TRACES_EXPORTER": "otlp",
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": collector.url,
            "OTEL_TRACES_SAMPLER_ARG": "1",
            "OTEL_SERVICE_NAME": "llm-d-decode",
            "OTEL_RESOURCE_ATTRIBUTES": "k8s.pod.name=decode-0,k8s.namespace.name=llm",
        }
        ready = lambda: answers(f"http://127.0.0.1:{admin}/readyz")  # noqa: E731
        with sidecar(args, env, ready, program=[sys.executable, "-m", "sidecar", "pd-sidecar"]):
            url = f"http://127.0.0.1:{port}/v1/completions"
            assert httpx.post(url, json=completion(), timeout=20).status_code == 200
        # The process stopped: its lifespan flushed the batch processor.
    resources = [
        {a.key: a.value.string_value for a in resource_spans.resource.attributes}
        for request in received
        for resource_spans in request.resource_spans
    ]
    assert resources, "no spans reached the collector"
    for resource in resources:
        assert resource["service.name"] == "llm-d-decode"
        assert resource["k8s.pod.name"] == "decode-0" and resource["k8s.namespace.name"] == "llm"


def test_tracing_off_never_imports_opentelemetry() -> None:
    script = textwrap.dedent(
        """
        import asyncio, sys
        from sidecar import cli
        from sidecar.server import serve
        from sidecar.app import create_app, create_admin_app
        from sidecar.config import Config

        async def main():
            app = create_app(Config(decode_url="http://127.0.0.1:9", release="dry-run"))
            create_admin_app(app)
            runtime = await app.startup()
            assert not runtime.tracing.enabled
            await app.shutdown()

        asyncio.run(main())
        loaded = sorted(m for m in sys.modules if m.startswith("opentelemetry"))
        assert not loaded, loaded
        print("ok")
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


@pytest.mark.nixl
def test_nixl_release_has_a_handshake_span_under_the_release_span() -> None:
    from sidecar.sim.decode import create_decode_app
    from sidecar.sim.decode.config import DecodeSimConfig
    from sidecar.sim.decode.nixl import VllmDHooks
    from sidecar.sim.prefill import PrefillSimConfig, create_prefill_app

    version = "0.33.0"
    p_app = create_prefill_app(
        PrefillSimConfig(port=0, vllm_version=version, tp=2, num_blocks=64, lease=0, side_channel_port=0)
    )
    d_config = DecodeSimConfig(port=0, version=version, max_model_len=40, model="m")
    exporter = InMemorySpanExporter()
    with (
        serve(p_app) as p,
        serve(create_decode_app(d_config, VllmDHooks(version))) as d,
        traced_sidecar(d.url, exporter, release="nixl", prefill_allow=("127.0.0.1",), prefill=(p.url,)) as sc,
    ):
        # A prompt over D's max_model_len: P prefilled it, D refuses it, the sidecar releases.
        body = {"model": "m", "prompt": " ".join(["tok"] * 60), "max_tokens": "x"}
        response = httpx.post(sc.url + "/v1/completions", json=body, headers={"traceparent": TRACEPARENT})
        assert response.status_code == 400
        sc.settle()
        spans = wait_spans(
            exporter, "kvr.proxy", "kvr.prefill", "kvr.decode", "kvr.release", "kvr.nixl.handshake"
        )
    release, handshake = spans["kvr.release"], spans["kvr.nixl.handshake"]
    assert {hexid(s.context.trace_id, 32) for s in spans.values()} == {TRACE_ID}
    assert release.parent is not None and release.parent.span_id == spans["kvr.proxy"].context.span_id
    assert handshake.parent is not None and handshake.parent.span_id == release.context.span_id
    attrs = dict(handshake.attributes or {})
    assert attrs["kvr.nixl.handshake.result"] == "ok" and attrs["server.address"] == "127.0.0.1"
    assert list(attrs["kvr.nixl.ranks"]) == ["0.0", "0.1"]  # type: ignore[arg-type]
    assert isinstance(attrs["server.port"], int) and attrs["kvr.nixl.engine_id"]
    assert handshake.kind is SpanKind.CLIENT and handshake.status.status_code is StatusCode.UNSET
    release_attrs = dict(release.attributes or {})
    assert release_attrs["kvr.release.strategy"] == "nixl" and release_attrs["kvr.release.result"] == "sent"
