"""``Tracing`` backed by the OpenTelemetry SDK (imported only when tracing is on: ``tracing.build``).

Attribute names follow the OpenTelemetry HTTP semantic conventions
(``http.request.method``, ``url.path``, ``server.address``,
``http.response.status_code``, ``error.type``); the sidecar's own are
``kvr.*``. Span status is ERROR for a 5xx answer to the client, a 4xx/5xx or
failed leg, an exception, and a release that failed, was refused or dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from importlib import metadata
from urllib.parse import SplitResult, unquote, urlsplit

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import NonRecordingSpan, Span, SpanContext, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from sidecar import __version__
from sidecar.asgi import Message, Scope, Send
from sidecar.config import Config
from sidecar.observability.spans import (
    TRACE_HEADERS,
    Headers,
    Leg,
    RequestSpan,
    TracedJob,
    Tracing,
    traces_url,
)

log = logging.getLogger("sidecar.tracing")

ERROR_RESULTS = frozenset({"failed", "refused", "dropped"})
_PROPAGATOR = TraceContextTextMapPropagator()


class _Request(RequestSpan):
    def __init__(self, span: Span) -> None:
        self.span = span

    def watch(self, send: Send) -> Send:
        span = self.span

        async def traced_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                status: int = message["status"]
                span.set_attribute("http.response.status_code", status)
                for name, value in message.get("headers", ()):
                    if name == b"x-request-id":
                        span.set_attribute("kvr.request_id", value.decode("latin-1"))
                        break
                if status >= 500:
                    span.set_status(Status(StatusCode.ERROR))
                    span.set_attribute("error.type", str(status))
            await send(message)

        return traced_send


class _Leg(Leg):
    def __init__(self, span: Span, headers: Headers) -> None:
        carrier: dict[str, str] = {}
        _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span))
        super().__init__([(n, v) for n, v in headers if n not in TRACE_HEADERS] + list(carrier.items()))
        self.span = span

    def status(self, code: int) -> None:
        self.span.set_attribute("http.response.status_code", code)
        if code >= 400:
            self.span.set_attribute("error.type", str(code))
            self.span.set_status(Status(StatusCode.ERROR))

    def failed(self, error_type: str, detail: str) -> None:
        self.span.set_attribute("error.type", error_type)
        self.span.set_status(Status(StatusCode.ERROR, detail))

    def end(self) -> None:
        self.span.end()


class _Release:
    __slots__ = ("attempts", "span")

    def __init__(self, span: Span) -> None:
        self.span = span
        self.attempts = 0


_REQUEST: ContextVar[_Request | None] = ContextVar("kvr_request_span", default=None)
_RELEASE: ContextVar[_Release | None] = ContextVar("kvr_release_span", default=None)


def resource_attributes(config: Config) -> dict[str, str]:
    """The spans' resource: ``trace_resource_attributes`` (``OTEL_RESOURCE_ATTRIBUTES``, values
    percent-decoded), then ``service.name`` from ``trace_service_name`` (``OTEL_SERVICE_NAME``)
    and the sidecar's ``service.version``, as llm-d's sidecar (Go) merges them. Built from the
    config alone: the SDK's own reading of the environment (``Resource.create``) is not used."""
    attributes = {
        "telemetry.sdk.language": "python",
        "telemetry.sdk.name": "opentelemetry",
        "telemetry.sdk.version": _sdk_version(),
    }
    for item in config.trace_resource_attributes:
        key, _, value = item.partition("=")
        attributes[key.strip()] = unquote(value.strip())
    attributes["service.name"] = config.trace_service_name
    attributes["service.version"] = __version__
    return attributes


def _sdk_version() -> str:
    try:
        return metadata.version("opentelemetry-sdk")
    except metadata.PackageNotFoundError:  # pragma: no cover - the SDK is imported above
        return "unknown"


class OtelTracing(Tracing):
    """Tracing on: spans go to ``exporter`` (tests) or to the OTLP/HTTP endpoint in batches."""

    enabled = True

    def __init__(self, config: Config, exporter: SpanExporter | None = None) -> None:
        resource = Resource(resource_attributes(config))
        sampler = ParentBased(TraceIdRatioBased(config.trace_sample_ratio))
        # shutdown() is ours (bounded, off the event loop), not an atexit hook's.
        self._provider = TracerProvider(sampler=sampler, resource=resource, shutdown_on_exit=False)
        processor: SpanProcessor
        if exporter is None:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            self.endpoint = traces_url(config.otlp_traces_endpoint)
            processor = BatchSpanProcessor(OTLPSpanExporter(endpoint=self.endpoint))
        else:
            self.endpoint = ""
            processor = SimpleSpanProcessor(exporter)  # synchronous: tests read spans as they end
        self._provider.add_span_processor(processor)
        self._tracer = self._provider.get_tracer("kv-release-sidecar", __version__)

    # --- the request path ------------------------------------------------------------------

    @contextmanager
    def server_span(self, scope: Scope) -> Iterator[RequestSpan]:
        carrier: dict[str, str] = {}
        for name, value in scope["headers"]:
            if name == b"traceparent" or name == b"tracestate":
                key, text = name.decode(), value.decode("latin-1")
                carrier[key] = f"{carrier[key]},{text}" if key in carrier else text
        parent = _PROPAGATOR.extract(carrier, context=Context()) if carrier else Context()
        span = self._tracer.start_span(
            "kvr.proxy",
            context=parent,
            kind=SpanKind.SERVER,
            attributes={
                "http.request.method": scope["method"],
                "url.path": scope["path"],
                "http.route": scope["path"],
                "url.scheme": scope.get("scheme", "http"),
                "network.protocol.version": scope.get("http_version", "1.1"),
            },
        )
        request = _Request(span)
        token = otel_context.attach(trace.set_span_in_context(span, parent))
        request_token = _REQUEST.set(request)
        try:
            yield request
        except BaseException as exc:
            _record(span, exc)
            raise
        finally:
            _REQUEST.reset(request_token)
            otel_context.detach(token)
            span.end()

    def decided(self, outcome: str, cause: str, release: str) -> None:
        request = _REQUEST.get()
        if request is not None:
            span = request.span
            span.set_attribute("kvr.outcome", outcome)
            span.set_attribute("kvr.cause", cause)
            span.set_attribute("kvr.release_decision", release)

    def job_context(self) -> SpanContext | None:
        request = _REQUEST.get()
        return request.span.get_span_context() if request is not None else None

    def leg(self, name: str, method: str, url: str, headers: Headers) -> Leg:
        return self._leg(name, method, url, headers)

    def _leg(self, name: str, method: str, url: str, headers: Headers) -> _Leg:
        parts = urlsplit(url)
        span = self._tracer.start_span(
            name,
            kind=SpanKind.CLIENT,
            attributes={
                "http.request.method": method,
                "server.address": parts.hostname or "",
                "server.port": parts.port or (443 if parts.scheme == "https" else 80),
                "url.full": _redacted(parts),
            },
        )
        return _Leg(span, headers)

    @contextmanager
    def leg_span(self, name: str, method: str, url: str, headers: Headers) -> Iterator[Leg]:
        leg = self._leg(name, method, url, headers)
        try:
            yield leg
        except BaseException as exc:
            failure = getattr(exc, "failure", None)  # UpstreamError
            status = getattr(exc, "status", None)  # RouterError: P's status, or the client's
            if isinstance(status, int) and getattr(exc, "body", None) is not None:
                leg.status(status)
            leg.failed(getattr(failure, "value", None) or type(exc).__name__, str(exc))
            _record(leg.span, exc, status=False)
            raise
        else:
            leg.status(200)
        finally:
            leg.end()

    # --- the release pipeline --------------------------------------------------------------

    @contextmanager
    def release_span(self, job: TracedJob, strategy: str) -> Iterator[None]:
        parent = job.trace_context
        context = trace.set_span_in_context(NonRecordingSpan(parent)) if parent is not None else Context()
        params = job.params
        span = self._tracer.start_span(
            "kvr.release",
            context=context,
            attributes={
                "kvr.release.strategy": strategy,
                "kvr.release.cause": job.cause,
                "kvr.request_id": job.request_id,
                "kvr.remote_engine_id": params.remote_engine_id or "",
                "kvr.remote_request_id": params.remote_request_id or "",
                "kvr.release.injected": job.injected,
            },
        )
        release = _Release(span)
        token = otel_context.attach(trace.set_span_in_context(span, context))
        release_token = _RELEASE.set(release)
        try:
            yield
        except BaseException as exc:  # the worker is stopped mid-job (CancelledError)
            span.set_attribute("kvr.release.result", "dropped")
            _record(span, exc)
            raise
        finally:
            span.set_attribute("kvr.release.attempts", release.attempts)
            _RELEASE.reset(release_token)
            otel_context.detach(token)
            span.end()

    def release_attempt(self, outcome: str) -> None:
        release = _RELEASE.get()
        if release is not None:
            release.attempts += 1
            if outcome != "ok":
                release.span.add_event("kvr.release.attempt_failed", {"kvr.release.reason": outcome})

    def release_finished(self, result: str, reason: str, detail: str) -> None:
        release = _RELEASE.get()
        if release is None:  # decided outside a job's run (duplicate at submit, dropped queue)
            return
        span = release.span
        span.set_attribute("kvr.release.result", result)
        if reason:
            span.set_attribute("kvr.release.reason", reason)
        if result in ERROR_RESULTS:
            span.set_attribute("error.type", reason or result)
            span.set_status(Status(StatusCode.ERROR, detail))

    @contextmanager
    def handshake_span(
        self, engine_id: str, endpoint: tuple[str, int], ranks: list[tuple[int, int]]
    ) -> Iterator[None]:
        host, port = endpoint
        span = self._tracer.start_span(
            "kvr.nixl.handshake",
            kind=SpanKind.CLIENT,
            attributes={
                "kvr.nixl.engine_id": engine_id,
                "server.address": host,
                "server.port": port,
                "kvr.nixl.ranks": [f"{pp}.{tp}" for pp, tp in ranks],
            },
        )
        token = otel_context.attach(trace.set_span_in_context(span))
        try:
            yield
        except BaseException as exc:
            reason = getattr(exc, "reason", None) or type(exc).__name__
            span.set_attribute("kvr.nixl.handshake.result", reason)
            span.set_attribute("error.type", reason)
            _record(span, exc)
            raise
        else:
            span.set_attribute("kvr.nixl.handshake.result", "ok")
        finally:
            otel_context.detach(token)
            span.end()

    # --- lifecycle -------------------------------------------------------------------------

    async def shutdown(self, timeout: float) -> None:  # noqa: ASYNC109 - a bound, not a cancel scope
        """Export what is buffered and stop, off the event loop; give up after ``timeout``."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()

        def close() -> None:
            try:
                self._provider.force_flush(int(timeout * 1000))
                self._provider.shutdown()
            finally:
                with contextlib.suppress(RuntimeError):  # the loop closed after a timeout
                    loop.call_soon_threadsafe(finished)

        def finished() -> None:
            if not done.done():
                done.set_result(None)

        # A daemon thread, not the default executor: a collector that hangs must not hold exit.
        threading.Thread(target=close, name="kvr-trace-flush", daemon=True).start()
        try:
            await asyncio.wait_for(asyncio.shield(done), timeout)
        except TimeoutError:
            log.warning("trace export did not finish in time", extra={"endpoint": self.endpoint})


def _record(span: Span, exc: BaseException, *, status: bool = True) -> None:
    """An exception event and, unless the caller set its own, status ERROR."""
    if isinstance(exc, asyncio.CancelledError | GeneratorExit):
        span.set_attribute("kvr.cancelled", True)
        if status:
            span.set_status(Status(StatusCode.ERROR, "cancelled"))
        return
    span.record_exception(exc)
    if status:
        span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))


def _redacted(parts: SplitResult) -> str:
    """``url.full`` without credentials (OpenTelemetry's HTTP conventions: a ``user:pass@`` in
    ``decode_url`` or a P URL must not reach the collector)."""
    if parts.username is None and parts.password is None:
        return parts.geturl()
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    netloc = f"REDACTED:REDACTED@{host}" + (f":{parts.port}" if parts.port is not None else "")
    return parts._replace(netloc=netloc).geturl()
