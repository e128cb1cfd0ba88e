"""Tracing off, and the words every span speaks: ``Tracing`` (each hook a no-op), ``OFF``,
``Leg`` and ``RequestSpan``, the ``TracedJob`` a release span reads, and the OTLP traces URL.

``sidecar.observability.otel.OtelTracing`` subclasses ``Tracing`` here;
``sidecar.observability.tracing`` picks one of the two from the config (the
SDK imported only when tracing is on), and re-exports these names.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, Protocol
from urllib.parse import urlsplit

from sidecar.asgi import Scope, Send

Headers = list[tuple[str, str]]
TRACE_HEADERS = frozenset({"traceparent", "tracestate"})


class Leg:
    """One outgoing HTTP request (a CLIENT span); off, nothing is recorded."""

    def __init__(self, headers: Headers) -> None:
        self.headers = headers  # what to send: the caller's, plus this span's traceparent when on

    def status(self, code: int) -> None:
        """The peer's HTTP status."""

    def failed(self, error_type: str, detail: str) -> None:
        """The leg failed before or instead of a usable answer."""

    def end(self) -> None:
        """The leg is over (the response body was read or abandoned)."""


class RequestSpan:
    """The ``kvr.proxy`` span of one request; off, ``watch`` returns ``send`` itself."""

    def watch(self, send: Send) -> Send:
        return send


class TracedParams(Protocol):
    """What a ``kvr.release`` span names of P's parameters."""

    @property
    def remote_engine_id(self) -> str: ...

    @property
    def remote_request_id(self) -> str | None: ...


class TracedJob(Protocol):
    """What a ``kvr.release`` span reads of a release job (``sidecar.release.base.ReleaseJob``):
    tracing speaks its own words, so it imports nothing of the release pipeline."""

    @property
    def trace_context(self) -> Any: ...

    @property
    def cause(self) -> str: ...

    @property
    def request_id(self) -> str: ...

    @property
    def injected(self) -> bool: ...

    @property
    def params(self) -> TracedParams: ...


class Tracing:
    """Tracing off: the base every hook falls back to. Subclassed by ``OtelTracing``."""

    enabled = False

    def server_span(self, scope: Scope) -> AbstractContextManager[RequestSpan]:
        """The ``kvr.proxy`` span around one inspected request (current while it runs)."""
        return nullcontext(RequestSpan())

    def decided(self, outcome: str, cause: str, release: str) -> None:
        """The request was classified; ``release`` says what became of its blocks."""

    def job_context(self) -> Any:
        """The current request's span context, for ``ReleaseJob.trace_context``."""
        return None

    def leg(self, name: str, method: str, url: str, headers: Headers) -> Leg:
        """A CLIENT span (``kvr.prefill``, ``kvr.decode``) for a request to ``url``."""
        return Leg(headers)

    @contextmanager
    def leg_span(self, name: str, method: str, url: str, headers: Headers) -> Iterator[Leg]:
        """``leg`` as a context manager: an exception ends it as failed (status, failure)."""
        yield Leg(headers)

    def release_span(self, job: TracedJob, strategy: str) -> AbstractContextManager[None]:
        """The ``kvr.release`` span around one job's attempts (on the pipeline's worker)."""
        return nullcontext()

    def release_attempt(self, outcome: str) -> None:
        """One attempt of the current job ended (``ok`` or a failure reason)."""

    def release_finished(self, result: str, reason: str, detail: str) -> None:
        """The current job's decision (``sidecar.release.base.JobResult``)."""

    def handshake_span(
        self, engine_id: str, endpoint: tuple[str, int], ranks: list[tuple[int, int]]
    ) -> AbstractContextManager[None]:
        """The ``kvr.nixl.handshake`` span (a child of the current release span)."""
        return nullcontext()

    async def shutdown(self, timeout: float) -> None:  # noqa: ASYNC109 - a bound, not a cancel scope
        """Flush what is buffered (bounded by ``timeout``) and stop exporting."""


OFF = Tracing()


def traces_url(endpoint: str) -> str:
    """The OTLP/HTTP traces URL: a bare ``http://host:4318`` gets ``/v1/traces``, a path is kept."""
    parts = urlsplit(endpoint)
    return parts._replace(path="/v1/traces").geturl() if parts.path in ("", "/") else endpoint
