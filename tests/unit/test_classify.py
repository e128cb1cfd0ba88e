"""Classification table: every outcome the proxy can report, and what it means for P's blocks."""

from __future__ import annotations

import pytest

from sidecar.classify import (
    ADMISSION_OVERFLOW_MESSAGES,
    ENGINE_FAULTED_MESSAGE,
    ENGINE_PAUSED_MESSAGE,
    Cause,
    Event,
    FirstEvent,
    NoAnswer,
    Outcome,
    classify,
    stream_event,
)

QUEUE_FULL, BACKLOG = sorted(ADMISSION_OVERFLOW_MESSAGES)
FAULTED = ENGINE_FAULTED_MESSAGE
STREAM_OPTIONS = "Stream options can only be defined when `stream=True`."


def answer(status: int, type_: str | None, message: str | None) -> Event:
    """D's error answer before any body byte."""
    return Event(status=status, error_type=type_, error_message=message)


def first(code: int, type_: str | None, message: str | None, stream: bool = True) -> Event:
    """A 200 whose first SSE event is vLLM's error."""
    return Event(status=200, stream=stream, first=FirstEvent(code, type_, message))


TABLE = [
    # definite rejections: release
    (Event(status=400), Outcome.RELEASE, Cause.REJECTED_4XX),
    (Event(status=401), Outcome.RELEASE, Cause.REJECTED_4XX),
    (Event(status=404), Outcome.RELEASE, Cause.REJECTED_4XX),
    (Event(status=413), Outcome.RELEASE, Cause.REJECTED_4XX),
    (Event(status=400, stream=True), Outcome.RELEASE, Cause.REJECTED_4XX),
    (Event(status=500), Outcome.RELEASE, Cause.REJECTED_5XX),
    (Event(status=501), Outcome.RELEASE, Cause.REJECTED_5XX),
    (Event(status=503), Outcome.RELEASE, Cause.REJECTED_5XX),
    (Event(failure=NoAnswer.CONNECT_REFUSED), Outcome.RELEASE, Cause.UNREACHABLE),
    (Event(failure=NoAnswer.DNS), Outcome.RELEASE, Cause.UNREACHABLE),
    (Event(failure=NoAnswer.CONNECT_TIMEOUT), Outcome.RELEASE, Cause.UNREACHABLE),
    (Event(failure=NoAnswer.POOL_TIMEOUT), Outcome.RELEASE, Cause.UNREACHABLE),
    (Event(failure=NoAnswer.BODY_TOO_LARGE), Outcome.RELEASE, Cause.BODY_TOO_LARGE),
    (Event(failure=NoAnswer.SHUTTING_DOWN), Outcome.RELEASE, Cause.SHUTTING_DOWN),
    (Event(failure=NoAnswer.OVERLOADED), Outcome.RELEASE, Cause.OVERLOADED),
    (Event(failure=NoAnswer.INJECTED), Outcome.RELEASE, Cause.INJECTED),
    (Event(failure=NoAnswer.CLIENT_GONE_BEFORE_FORWARD), Outcome.RELEASE, Cause.CLIENT_GONE_BEFORE_FORWARD),
    (Event(failure=NoAnswer.PREFILL_ANSWER_TOO_LARGE), Outcome.RELEASE, Cause.PREFILL_ANSWER_TOO_LARGE),
    (
        Event(status=200, stream=True, first=FirstEvent(400, None)),
        Outcome.RELEASE,
        Cause.STREAM_ADMISSION_ERROR,
    ),
    (
        Event(status=200, stream=True, first=FirstEvent(422, None)),
        Outcome.RELEASE,
        Cause.STREAM_ADMISSION_ERROR,
    ),
    # vLLM 0.29.0+: AsyncLLM._add_request's queue limits, before the engine core has the request
    (first(503, "Service Unavailable", QUEUE_FULL), Outcome.RELEASE, Cause.STREAM_ADMISSION_OVERFLOW),
    (first(503, "Service Unavailable", BACKLOG), Outcome.RELEASE, Cause.STREAM_ADMISSION_OVERFLOW),
    # vLLM 0.33.0's paused engine core: a definite rejection, which D's engine core releases itself
    (first(503, "InternalServerError", ENGINE_PAUSED_MESSAGE), Outcome.RELEASE, Cause.STREAM_ENGINE_PAUSED),
    (
        first(503, "ServiceUnavailableError", ENGINE_PAUSED_MESSAGE),
        Outcome.RELEASE,
        Cause.STREAM_ENGINE_PAUSED,
    ),
    # vLLM 0.34.0's faulted engine: refused by the admission check; D's own release waits in the
    # faulted engine core, so it has a cause of its own
    (answer(503, "Service Unavailable", FAULTED), Outcome.RELEASE, Cause.ENGINE_FAULTED),
    (answer(503, "overloaded_error", FAULTED), Outcome.RELEASE, Cause.ENGINE_FAULTED),  # /v1/messages
    (first(503, "Service Unavailable", FAULTED), Outcome.RELEASE, Cause.STREAM_ENGINE_FAULTED),
    (first(503, "overloaded_error", FAULTED), Outcome.RELEASE, Cause.STREAM_ENGINE_FAULTED),
    # ... only to the letter: otherwise an ordinary 503 (or an ambiguous stream error)
    (answer(503, "Service Unavailable", QUEUE_FULL), Outcome.RELEASE, Cause.REJECTED_5XX),
    (answer(503, "Service Unavailable", FAULTED + "."), Outcome.RELEASE, Cause.REJECTED_5XX),
    (answer(503, "ServiceUnavailableError", FAULTED), Outcome.RELEASE, Cause.REJECTED_5XX),
    (answer(500, "Service Unavailable", FAULTED), Outcome.RELEASE, Cause.REJECTED_5XX),
    (answer(503, None, FAULTED), Outcome.RELEASE, Cause.REJECTED_5XX),
    (first(503, "InternalServerError", FAULTED), Outcome.AMBIGUOUS, Cause.STREAM_ERROR_5XX),
    (first(500, "Service Unavailable", FAULTED), Outcome.AMBIGUOUS, Cause.STREAM_ERROR_5XX),
    (first(503, "Service Unavailable", FAULTED, stream=False), Outcome.NO_RELEASE, Cause.ADMITTED),
    # vLLM 0.27.0+: a request model's validator raised VLLMValidationError, answered before the
    # handler with a handler's type: told apart by its message, never left to D's own release
    (
        answer(400, "BadRequestError", STREAM_OPTIONS + " (parameter=stream_options)"),
        Outcome.RELEASE,
        Cause.REJECTED_VALIDATION,
    ),
    (
        answer(400, "BadRequestError", "`n` must be an integer. (parameter=n, value=x)"),
        Outcome.RELEASE,
        Cause.REJECTED_VALIDATION,
    ),
    (answer(400, "BadRequestError", STREAM_OPTIONS), Outcome.RELEASE, Cause.REJECTED_VALIDATION),
    (answer(400, "Bad Request", STREAM_OPTIONS), Outcome.RELEASE, Cause.REJECTED_4XX),  # before 0.27.0
    (answer(400, "BadRequestError", STREAM_OPTIONS + "!"), Outcome.RELEASE, Cause.REJECTED_4XX),
    (answer(400, "BadRequestError", "The prompt is too long."), Outcome.RELEASE, Cause.REJECTED_4XX),
    (answer(422, "BadRequestError", STREAM_OPTIONS), Outcome.RELEASE, Cause.REJECTED_4XX),
    # admitted: D reads and notifies P itself
    (Event(status=200), Outcome.NO_RELEASE, Cause.ADMITTED),
    (Event(status=201), Outcome.NO_RELEASE, Cause.ADMITTED),
    (Event(status=200, stream=True), Outcome.NO_RELEASE, Cause.ADMITTED),
    # an error field in a non-stream 200 body is not a stream admission failure
    (Event(status=200, stream=False, first=FirstEvent(400, None)), Outcome.NO_RELEASE, Cause.ADMITTED),
    (Event(status=302), Outcome.NO_RELEASE, Cause.OTHER_STATUS),
    (Event(status=300), Outcome.NO_RELEASE, Cause.OTHER_STATUS),  # the edges of the 2xx and 5xx ranges
    (Event(status=299), Outcome.NO_RELEASE, Cause.ADMITTED),
    (Event(status=599), Outcome.RELEASE, Cause.REJECTED_5XX),
    (Event(status=600), Outcome.NO_RELEASE, Cause.OTHER_STATUS),
    # ambiguous: D may have admitted it
    (first(500, None, None), Outcome.AMBIGUOUS, Cause.STREAM_ERROR_5XX),
    (first(503, None, None), Outcome.AMBIGUOUS, Cause.STREAM_ERROR_5XX),
    # the overflow and paused answers only when every field is vLLM's, to the letter
    (first(503, "Service Unavailable", QUEUE_FULL + " "), Outcome.AMBIGUOUS, Cause.STREAM_ERROR_5XX),
    (first(503, "Service Unavailable", "busy"), Outcome.AMBIGUOUS, Cause.STREAM_ERROR_5XX),
    (first(503, "Service Unavailable", None), Outcome.AMBIGUOUS, Cause.STREAM_ERROR_5XX),
    (first(503, "ServiceUnavailableError", QUEUE_FULL), Outcome.AMBIGUOUS, Cause.STREAM_ERROR_5XX),
    (first(503, None, QUEUE_FULL), Outcome.AMBIGUOUS, Cause.STREAM_ERROR_5XX),
    (first(500, "Service Unavailable", QUEUE_FULL), Outcome.AMBIGUOUS, Cause.STREAM_ERROR_5XX),
    (first(503, "BadRequestError", ENGINE_PAUSED_MESSAGE), Outcome.AMBIGUOUS, Cause.STREAM_ERROR_5XX),
    (first(500, "InternalServerError", ENGINE_PAUSED_MESSAGE), Outcome.AMBIGUOUS, Cause.STREAM_ERROR_5XX),
    (first(503, "Service Unavailable", QUEUE_FULL, stream=False), Outcome.NO_RELEASE, Cause.ADMITTED),
    (Event(status=502), Outcome.AMBIGUOUS, Cause.GATEWAY_ERROR),
    (Event(status=504), Outcome.AMBIGUOUS, Cause.GATEWAY_ERROR),
    (Event(failure=NoAnswer.HEADER_TIMEOUT), Outcome.AMBIGUOUS, Cause.HEADER_TIMEOUT),
    (Event(failure=NoAnswer.RESET_AFTER_SEND), Outcome.AMBIGUOUS, Cause.RESET_AFTER_SEND),
    (Event(failure=NoAnswer.CLIENT_GONE_AFTER_FORWARD), Outcome.AMBIGUOUS, Cause.CLIENT_GONE_AFTER_FORWARD),
]


@pytest.mark.parametrize(("event", "outcome", "cause"), TABLE)
def test_classify(event: Event, outcome: Outcome, cause: Cause) -> None:
    decision = classify(event)
    assert (decision.outcome, decision.cause) == (outcome, cause)


def test_every_failure_is_classified() -> None:
    for failure in NoAnswer:
        assert classify(Event(failure=failure)).cause is not None


@pytest.mark.parametrize(
    ("outcome", "flag", "expected"),
    [
        (Outcome.RELEASE, False, True),
        (Outcome.RELEASE, True, True),
        (Outcome.AMBIGUOUS, False, False),
        (Outcome.AMBIGUOUS, True, True),
        (Outcome.NO_RELEASE, True, False),
    ],
)
def test_release_ambiguous_setting(outcome: Outcome, flag: bool, expected: bool) -> None:
    event = {
        Outcome.RELEASE: Event(status=400),
        Outcome.AMBIGUOUS: Event(failure=NoAnswer.HEADER_TIMEOUT),
        Outcome.NO_RELEASE: Event(status=200),
    }[outcome]
    assert classify(event).releases(flag) is expected


@pytest.mark.parametrize(
    "first_event",
    [
        FirstEvent(None, None),
        FirstEvent(400, "BadRequestError", "bad"),
        FirstEvent(503, None, ENGINE_PAUSED_MESSAGE),
    ],
)
def test_a_streams_first_event_is_judged_as_a_200_with_that_event(first_event: FirstEvent) -> None:
    assert stream_event(first_event) == Event(status=200, stream=True, first=first_event, started=True)


def test_where_no_answer_arrived_the_cause_is_the_no_answer_itself_or_unreachable() -> None:
    """The ``cause`` label of a no-answer is its own value; D's connection failing before the
    request was sent is ``unreachable`` whichever way it failed."""
    before_sending = {
        NoAnswer.CONNECT_REFUSED,
        NoAnswer.DNS,
        NoAnswer.CONNECT_TIMEOUT,
        NoAnswer.TLS_FAILED,
        NoAnswer.POOL_TIMEOUT,
    }
    for reason in NoAnswer:
        cause = classify(Event(failure=reason)).cause
        assert cause == (Cause.UNREACHABLE if reason in before_sending else Cause(reason.value)), reason
