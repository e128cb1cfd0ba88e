"""What a request's fate means for P's blocks: a pure function, tested with a table.

The proxy reports one ``Event`` per inspected request: D's status (and, for
a stream, the code of an error in its first SSE event), or the failure that
kept an answer from arriving. ``classify`` turns it into an ``Outcome`` and a
``Cause``. Only a definite pre-admission rejection releases: once D may have
admitted the request it may read P's blocks, and a release then lets P reuse
them under an in-flight READ (silently wrong output).

Gateway statuses (502, 504) never come from vLLM itself; they come from a
layer between us and D that may have delivered the request, so they are
ambiguous, like a timeout after sending.

A 4xx/5xx status before any body byte is taken as a rejection before
admission. vLLM has a few answers that break that rule (docs/operations.md,
"Where the classification is not exact"): a non-streaming 500 for a request
that finished with an error, a pre-0.21.0 400 from output processing after
the request finished (both: D already read and notified, so the release only
repeats a done notification), and the 400 every in-flight request gets when
D's output handler dies (D's engine is then terminated).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class Outcome(StrEnum):
    RELEASE = "release"
    NO_RELEASE = "no_release"
    AMBIGUOUS = "ambiguous"  # D may have admitted it; released only if configured


class Cause(StrEnum):
    # definite rejections: D never admitted the request
    REJECTED_4XX = "rejected_4xx"
    REJECTED_5XX = "rejected_5xx"
    UNREACHABLE = "unreachable"
    BODY_TOO_LARGE = "body_too_large"
    SHUTTING_DOWN = "shutting_down"
    OVERLOADED = "overloaded"  # over the sidecar's own limit_concurrency
    INJECTED = "injected"
    CLIENT_GONE_BEFORE_FORWARD = "client_gone_before_forward"
    STREAM_ADMISSION_ERROR = "stream_admission_error"
    # D admitted it (or will handle it itself)
    ADMITTED = "admitted"
    OTHER_STATUS = "other_status"
    # ambiguous: D may have received and admitted it
    HEADER_TIMEOUT = "header_timeout"
    RESET_AFTER_SEND = "reset_after_send"
    GATEWAY_ERROR = "gateway_error"
    STREAM_ERROR_5XX = "stream_error_5xx"
    CLIENT_GONE_AFTER_FORWARD = "client_gone_after_forward"
    # router mode with decode_releases: the decode sidecar judged D's answer and releases it
    DELEGATED = "delegated"


class Failure(StrEnum):
    """Why no status arrived from D (or why the sidecar answered itself)."""

    CONNECT_REFUSED = "connect_refused"
    DNS = "dns"
    CONNECT_TIMEOUT = "connect_timeout"
    POOL_TIMEOUT = "pool_timeout"
    HEADER_TIMEOUT = "header_timeout"
    RESET_AFTER_SEND = "reset_after_send"
    BODY_TOO_LARGE = "body_too_large"
    SHUTTING_DOWN = "shutting_down"
    OVERLOADED = "overloaded"
    INJECTED = "injected"
    CLIENT_GONE_BEFORE_FORWARD = "client_gone_before_forward"
    CLIENT_GONE_AFTER_FORWARD = "client_gone_after_forward"


@dataclass(frozen=True, slots=True)
class Event:
    """What happened to one request. Exactly one of ``status`` / ``failure`` is set."""

    status: int | None = None
    stream: bool = False
    # The ``code`` of an error in the first SSE event of a 200 stream, if any.
    first_event_error: int | None = None
    failure: Failure | None = None


@dataclass(frozen=True, slots=True)
class Decision:
    outcome: Outcome
    cause: Cause

    def releases(self, release_ambiguous: bool) -> bool:
        return self.outcome is Outcome.RELEASE or (release_ambiguous and self.outcome is Outcome.AMBIGUOUS)


_FAILURES: dict[Failure, Decision] = {
    Failure.CONNECT_REFUSED: Decision(Outcome.RELEASE, Cause.UNREACHABLE),
    Failure.DNS: Decision(Outcome.RELEASE, Cause.UNREACHABLE),
    Failure.CONNECT_TIMEOUT: Decision(Outcome.RELEASE, Cause.UNREACHABLE),
    Failure.POOL_TIMEOUT: Decision(Outcome.RELEASE, Cause.UNREACHABLE),
    Failure.BODY_TOO_LARGE: Decision(Outcome.RELEASE, Cause.BODY_TOO_LARGE),
    Failure.SHUTTING_DOWN: Decision(Outcome.RELEASE, Cause.SHUTTING_DOWN),
    Failure.OVERLOADED: Decision(Outcome.RELEASE, Cause.OVERLOADED),
    Failure.INJECTED: Decision(Outcome.RELEASE, Cause.INJECTED),
    Failure.CLIENT_GONE_BEFORE_FORWARD: Decision(Outcome.RELEASE, Cause.CLIENT_GONE_BEFORE_FORWARD),
    Failure.HEADER_TIMEOUT: Decision(Outcome.AMBIGUOUS, Cause.HEADER_TIMEOUT),
    Failure.RESET_AFTER_SEND: Decision(Outcome.AMBIGUOUS, Cause.RESET_AFTER_SEND),
    Failure.CLIENT_GONE_AFTER_FORWARD: Decision(Outcome.AMBIGUOUS, Cause.CLIENT_GONE_AFTER_FORWARD),
}

_GATEWAY = frozenset({502, 504})

# Router mode holds P's parameters and closes its connection to D in these cases,
# which aborts D's request: no live request reads the blocks any more.
ROUTER_RELEASES = frozenset({Cause.HEADER_TIMEOUT, Cause.CLIENT_GONE_AFTER_FORWARD})


def classify(event: Event) -> Decision:
    """The outcome of one inspected request (see the module docstring)."""
    if event.failure is not None:
        return _FAILURES[event.failure]
    status = event.status or 0
    if 200 <= status < 300:
        return _classify_admitted(event)
    if status in _GATEWAY:
        return Decision(Outcome.AMBIGUOUS, Cause.GATEWAY_ERROR)
    if 400 <= status < 500:
        return Decision(Outcome.RELEASE, Cause.REJECTED_4XX)
    if 500 <= status < 600:
        return Decision(Outcome.RELEASE, Cause.REJECTED_5XX)
    # 1xx/3xx: vLLM sends neither; not a rejection we can vouch for.
    return Decision(Outcome.NO_RELEASE, Cause.OTHER_STATUS)


def _classify_admitted(event: Event) -> Decision:
    code = event.first_event_error
    if not event.stream or code is None:
        return Decision(Outcome.NO_RELEASE, Cause.ADMITTED)
    if 400 <= code < 500:
        # vLLM's engine refused the request after the 200 went out: the stream's first event is
        # the error (the engine's admission of the request failed; nothing was read from P).
        return Decision(Outcome.RELEASE, Cause.STREAM_ADMISSION_ERROR)
    return Decision(Outcome.AMBIGUOUS, Cause.STREAM_ERROR_5XX)
