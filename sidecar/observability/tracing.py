"""OpenTelemetry tracing, an optional extra (``pip install "<checkout>[otel]"``).

Off unless ``otlp_traces_endpoint`` is set. Off, ``build`` returns ``OFF``, a
``Tracing`` whose ``enabled`` is False: every hook on the request path and in
the release pipeline is guarded by that one attribute, so tracing costs one
attribute check per hook and ``opentelemetry`` is never imported. On, it
returns ``sidecar.observability.otel.OtelTracing``: a TracerProvider with a
parent-based ratio sampler, a BatchSpanProcessor and the OTLP/HTTP exporter,
flushed and shut down when the app stops. ``Tracing``, ``OFF`` and the types
the hooks speak live in ``sidecar.observability.spans`` (re-exported here),
which ``otel`` builds on: ``otel`` never imports this module.

Spans (documented in docs/tracing.md):

* ``kvr.proxy`` (SERVER): one per inspected request; parent: the client's
  ``traceparent``/``tracestate``.
* ``kvr.prefill`` / ``kvr.decode`` (CLIENT): the legs to P and D; each sends
  its own ``traceparent`` (the client's is replaced on that leg).
* ``kvr.release`` (INTERNAL): one per release job, on the pipeline's worker,
  a child of the request's ``kvr.proxy`` span (carried on the job).
* ``kvr.nixl.handshake`` (CLIENT): the side-channel handshake with P, a child
  of the release span; created on the event loop, never on the NIXL thread.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sidecar.config import Config, ConfigError
from sidecar.extras import MissingExtra
from sidecar.observability.spans import (
    OFF,
    TRACE_HEADERS,
    Headers,
    Leg,
    RequestSpan,
    TracedJob,
    TracedParams,
    Tracing,
    traces_url,
)

if TYPE_CHECKING:  # the SDK is an optional extra: types only
    from opentelemetry.sdk.trace.export import SpanExporter


def require(config: Config) -> None:
    """Raise ``ConfigError`` when tracing is configured but the ``otel`` extra is missing."""
    if not config.otlp_traces_endpoint:
        return
    try:
        import opentelemetry.exporter.otlp.proto.http.trace_exporter
        import opentelemetry.sdk.trace  # noqa: F401
    except ImportError as exc:
        missing = MissingExtra("tracing", "otel", exc.name or str(exc))
        raise ConfigError("otlp_traces_endpoint", config.otlp_traces_endpoint, str(missing)) from exc


def build(config: Config, exporter: SpanExporter | None = None) -> Tracing:
    """``OFF`` unless ``otlp_traces_endpoint`` is set or an ``exporter`` (tests) is given."""
    if exporter is None and not config.otlp_traces_endpoint:
        return OFF
    if exporter is None:
        require(config)
    from sidecar.observability.otel import OtelTracing  # the SDK only when tracing is on

    return OtelTracing(config, exporter)


__all__ = [
    "OFF",
    "TRACE_HEADERS",
    "Headers",
    "Leg",
    "RequestSpan",
    "TracedJob",
    "TracedParams",
    "Tracing",
    "build",
    "require",
    "traces_url",
]
