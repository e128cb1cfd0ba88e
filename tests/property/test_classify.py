"""``sidecar.classify.classify``: total, and a release only for a definite pre-admission rejection."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from sidecar.classify import (
    ADMISSION_OVERFLOW_MESSAGES,
    ADMISSION_OVERFLOW_TYPE,
    ENGINE_FAULTED_MESSAGE,
    ENGINE_PAUSED_MESSAGE,
    Cause,
    Event,
    FirstEvent,
    NoAnswer,
    Outcome,
    classify,
)

statuses = st.one_of(st.none(), st.integers(min_value=-1, max_value=1000), st.integers())
codes = st.one_of(st.none(), st.integers(min_value=0, max_value=700), st.integers())
VLLM_TYPES = [
    ADMISSION_OVERFLOW_TYPE,
    "InternalServerError",
    "ServiceUnavailableError",
    "BadRequestError",
    "overloaded_error",
]
VLLM_MESSAGES = [*sorted(ADMISSION_OVERFLOW_MESSAGES), ENGINE_PAUSED_MESSAGE, ENGINE_FAULTED_MESSAGE]
types = st.one_of(st.none(), st.sampled_from(VLLM_TYPES), st.text(max_size=30))
messages = st.one_of(st.none(), st.sampled_from(VLLM_MESSAGES), st.text(max_size=120))
events = st.builds(
    Event,
    status=st.one_of(statuses, st.just(503)),
    stream=st.booleans(),
    error_type=types,
    error_message=messages,
    first=st.one_of(
        st.none(),
        st.builds(
            FirstEvent,
            st.one_of(codes, st.just(503)),
            types,
            messages,
        ),
    ),
    failure=st.one_of(st.none(), st.sampled_from(list(NoAnswer))),
)

DEFINITE = {
    Cause.REJECTED_4XX,
    Cause.REJECTED_VALIDATION,
    Cause.REJECTED_5XX,
    Cause.UNREACHABLE,
    Cause.BODY_TOO_LARGE,
    Cause.SHUTTING_DOWN,
    Cause.OVERLOADED,
    Cause.INJECTED,
    Cause.CLIENT_GONE_BEFORE_FORWARD,
    Cause.PREFILL_ANSWER_TOO_LARGE,
    Cause.STREAM_ADMISSION_ERROR,
    Cause.STREAM_ADMISSION_OVERFLOW,
    Cause.STREAM_ENGINE_PAUSED,
    Cause.ENGINE_FAULTED,
    Cause.STREAM_ENGINE_FAULTED,
}


@given(events)
def test_every_event_has_one_decision(event: Event) -> None:
    decision = classify(event)
    assert decision.outcome in Outcome and decision.cause in Cause
    assert (decision.outcome is Outcome.RELEASE) == (decision.cause in DEFINITE)
    assert decision.releases(False) == (decision.outcome is Outcome.RELEASE)
    assert decision.releases(True) == (decision.outcome is not Outcome.NO_RELEASE)


@given(events)
def test_a_release_needs_a_rejection_d_never_admitted(event: Event) -> None:
    decision = classify(event)
    if event.failure is not None or decision.outcome is not Outcome.RELEASE:
        return
    status = event.status or 0
    if 200 <= status < 300:  # only an in-band error in a stream's first event: 4xx, or vLLM's own 503s
        assert event.first is not None
        code, message = event.first.error_code, event.first.error_message
        assert event.stream and code is not None
        assert 400 <= code < 500 or (code == 503 and message in VLLM_MESSAGES)
    else:
        assert 400 <= status < 600 and status not in (502, 504)


@given(st.integers(), st.booleans(), codes)
def test_statuses_outside_4xx_5xx_never_release_without_a_stream_error(
    status: int, stream: bool, code: int | None
) -> None:
    if 400 <= status < 600:
        return
    decision = classify(Event(status=status, stream=stream, first=FirstEvent(code, None)))
    if not (200 <= status < 300 and stream and code is not None and 400 <= code < 500):
        assert decision.outcome is not Outcome.RELEASE


@given(st.sampled_from([502, 504]), st.booleans(), codes)
def test_gateway_statuses_are_ambiguous(status: int, stream: bool, code: int | None) -> None:
    assert (
        classify(Event(status=status, stream=stream, first=FirstEvent(code, None))).outcome
        is Outcome.AMBIGUOUS
    )


@given(st.sampled_from(list(NoAnswer)), statuses, codes)
def test_a_failure_decides_whatever_else_the_event_says(
    failure: NoAnswer, status: int | None, code: int | None
) -> None:
    assert classify(Event(status=status, first=FirstEvent(code, None), failure=failure)) == classify(
        Event(failure=failure)
    )
