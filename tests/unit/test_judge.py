"""The judge itself, without a proxy around it: what it decides, records and hands over.

``tests/unit/test_proxy.py`` drives the judge through the request path; here
``Judge`` and ``StreamJudge`` are called directly with an ``Exchange``, so
each step of the decision (module docstring of ``sidecar.decision.judge``) shows
in what it leaves behind: the job handed to the pipeline (every field), the
in-flight veto's state, the metrics, and the decision reported to tracing.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from sidecar.classify import Cause, Event, NoAnswer, Outcome
from sidecar.decision.judge import StreamJudge
from sidecar.decision.policy import ROUTER, SIDECAR, Policy, router_policy
from sidecar.observability.metrics import Metrics
from sidecar.release.base import ReleaseJob
from tests.support.fakes import FakeDecode, release_params
from tests.unit.exchanges import PARAMS, Rig, exchange
from tests.unit.rigs import V033

REFUSAL = b'data: {"error": {"message": "bad", "type": "BadRequestError", "param": null, "code": 400}}\n\n'


class Rehearses:
    """A live strategy's dry run as the judge sees it: checked, freeing nothing."""

    frees = False
    checked = True


@pytest.mark.parametrize(
    ("event", "settings", "queued", "traced"),
    [
        (Event(status=400), {}, True, ("release", "rejected_4xx", "queued")),
        (Event(status=400), {}, False, ("release", "rejected_4xx", "duplicate")),
        (Event(status=503), {}, True, ("release", "rejected_5xx", "retryable")),
        (Event(status=200), {}, True, ("no_release", "admitted", "not_released")),
        (
            Event(failure=NoAnswer.RESET_AFTER_SEND),
            {},
            True,
            ("ambiguous", "reset_after_send", "not_released"),
        ),
    ],
    ids=["queued", "duplicate", "retryable", "admitted", "ambiguous"],
)
def test_each_decision_is_traced_with_what_became_of_the_blocks(
    event: Event, settings: dict[str, Any], queued: bool, traced: tuple[str, str, str]
) -> None:
    rig = Rig(queued, **settings)
    made = exchange()
    decision = rig.judge.judge(made, event)
    assert made.decided is True and made.judged is not None and made.judged.decision == decision
    assert made.spent is (traced[2] in ("queued", "duplicate"))  # handed to a strategy that frees
    assert rig.traces.decisions == [traced]
    assert (decision.outcome.value, decision.cause.value) == traced[:2]
    assert len(rig.queue.jobs) == (traced[2] in ("queued", "duplicate"))


def test_an_exchange_without_parameters_is_decided_and_traced_but_not_handed_over() -> None:
    rig = Rig()
    made = exchange(params=None)
    rig.judge.judge(made, Event(status=400))
    assert made.decided is True and rig.queue.jobs == []
    assert rig.traces.decisions == [("release", "rejected_4xx", "no_params")]


def test_parameters_d_may_be_reading_are_not_released_and_the_refusal_is_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    rig = Rig()
    live = exchange(request_id="live")
    rig.judge.forwarded(live)  # a copy at D
    assert rig.inflight.may_be_read(live.key)
    with caplog.at_level(logging.WARNING, logger="sidecar.proxy"):
        rig.judge.judge(exchange(request_id="replay", sent=False), Event(status=400))
    assert rig.queue.jobs == []
    assert rig.traces.decisions == [("release", "rejected_4xx", "params_in_use")]
    assert rig.sample("kvr_not_released_total", outcome="no_release", cause="params_in_use") == 1
    [record] = caplog.records
    assert record.getMessage() == "rejected request reuses parameters D may be reading; not released"
    assert record.request_id == "replay"  # type: ignore[attr-defined]


def test_a_judged_rejection_no_longer_holds_its_parameters() -> None:
    rig = Rig()
    made = exchange()
    rig.judge.forwarded(made)
    rig.judge.judge(made, Event(status=400))
    assert not rig.inflight.may_be_read(made.key)  # released: nothing at D holds them
    assert rig.sample("kvr_rejections_total", cause="rejected_4xx") == 1


def test_the_job_carries_what_the_strategies_need() -> None:
    rig = Rig(releaser=Rehearses(), release_deadline=7.0)
    made = exchange(
        route="/v1/chat/completions",
        raw_params=b'{"do_remote_prefill": true}',
        body_request_id="body-1",
        data_parallel_rank=1,
        request_id_generated=True,
        vouched=True,
    )
    rig.judge.judge(made, Event(status=404, error_type="NotFoundError"))
    [job] = rig.queue.jobs
    assert job.vouched is True  # the parameters' ranks are P's own topology
    assert (job.request_id, job.route, job.body_request_id) == ("req-1", "/v1/chat/completions", "body-1")
    assert (job.raw_params, job.data_parallel_rank) == (b'{"do_remote_prefill": true}', 1)
    assert job.request_id_generated is True and job.params == PARAMS
    assert (job.cause, job.status, job.error_type) == (Cause.REJECTED_4XX, 404, "NotFoundError")
    assert job.injected is False and job.decode_reachable is True
    assert job.trace_context == "the request's span"
    assert job.deadline - job.detected_at == pytest.approx(7.0)
    assert made.spent is False  # a dry run frees nothing


def test_the_sidecars_own_answer_is_the_jobs_status_and_failures_say_so() -> None:
    rig = Rig(retried_statuses=("none",))
    rig.judge.judge(exchange(request_id="a"), Event(failure=NoAnswer.INJECTED, answer=429))
    rig.judge.judge(
        exchange(request_id="b", params=release_params({**V033, "remote_request_id": "b"})),
        Event(failure=NoAnswer.CONNECT_REFUSED),
    )
    injected, unreachable = rig.queue.jobs
    assert (injected.status, injected.injected, injected.decode_reachable) == (429, True, True)
    assert (unreachable.status, unreachable.injected, unreachable.decode_reachable) == (None, False, False)
    assert injected.request_id_generated is False


def test_under_the_shipped_default_d_unreachable_is_left_to_the_retry() -> None:
    rig = Rig()  # Config's own retried_statuses: 502, 503, 504
    rig.judge.judge(exchange(request_id="a"), Event(failure=NoAnswer.INJECTED, answer=429))
    rig.judge.judge(
        exchange(request_id="b", params=release_params({**V033, "remote_request_id": "b"})),
        Event(failure=NoAnswer.CONNECT_REFUSED),
    )
    [injected] = rig.queue.jobs  # D unreachable: the sidecar's 503 may be retried on another pod
    assert (injected.request_id, injected.status, injected.injected) == ("a", 429, True)


def test_a_router_never_marks_its_request_id_as_the_clients() -> None:
    rig = Rig()
    rig.judge.judge(exchange(ROUTER, request_id_generated=True), Event(status=400))
    [job] = rig.queue.jobs
    assert job.request_id_generated is False  # a router's client retries with a fresh prefill


def test_a_router_releases_what_it_aborted_and_keeps_the_parameters_from_a_second_release() -> None:
    rig = Rig()
    made = exchange(ROUTER)
    decision = rig.judge.judge(made, Event(failure=NoAnswer.CLIENT_GONE_AFTER_FORWARD))
    assert (decision.outcome, decision.cause) == (Outcome.RELEASE, Cause.CLIENT_GONE_AFTER_FORWARD)
    assert [job.cause for job in rig.queue.jobs] == [Cause.CLIENT_GONE_AFTER_FORWARD]
    assert rig.inflight.may_be_read(made.key)  # D may still be reading while its handler aborts


@pytest.mark.parametrize(
    ("policy", "sent", "event"),
    [
        (SIDECAR, True, Event(status=400)),  # D refused: nothing to abort
        (ROUTER, False, Event(failure=NoAnswer.HEADER_TIMEOUT)),  # never reached D
        (ROUTER, True, Event(status=400)),
    ],
)
def test_only_an_abort_of_a_request_d_had_keeps_the_parameters(
    policy: Policy, sent: bool, event: Event
) -> None:
    rig = Rig()
    made = exchange(policy, sent=sent)
    rig.judge.judge(made, event)
    assert len(rig.queue.jobs) == 1 and not rig.inflight.may_be_read(made.key)


def test_what_the_judge_is_told_of_d_reaches_ds_state() -> None:
    decode = FakeDecode(None)
    rig = Rig(decode=decode)
    rig.judge.judge(exchange(), Event(status=503, error_message="down", closing=True))
    assert decode.observed == [(503, "down", True)]


@pytest.mark.parametrize(("status", "cause"), [(503, "status_5xx"), (400, "status_4xx"), (404, "status_4xx")])
def test_a_routers_decode_leg_counts_its_answers(status: int, cause: str) -> None:
    metrics = Metrics(CollectorRegistry())
    ROUTER.decode_answered(metrics, status, 0.25)
    ROUTER.decode_answered(metrics, 399, 0.25)
    ROUTER.decode_failed(metrics, NoAnswer.CONNECT_REFUSED)
    SIDECAR.decode_answered(metrics, status, 0.25)
    SIDECAR.decode_failed(metrics, NoAnswer.CONNECT_REFUSED)
    registry = metrics.registry
    assert registry.get_sample_value("kvr_leg_latency_seconds_count", {"leg": "decode"}) == 2
    assert registry.get_sample_value("kvr_leg_failures_total", {"leg": "decode", "cause": cause}) == 1
    failed = {"leg": "decode", "cause": "connect_refused"}
    assert registry.get_sample_value("kvr_leg_failures_total", failed) == 1


def test_a_stream_is_judged_on_its_first_event_with_its_error_type() -> None:
    decode = FakeDecode(None)
    rig = Rig(decode=decode)
    made = exchange(stream=True)
    stream = StreamJudge(rig.judge, made)
    stream.feed(REFUSAL[:20])
    assert not stream.decided and rig.queue.jobs == []
    stream.feed(REFUSAL[20:])
    assert stream.decided
    [job] = rig.queue.jobs
    assert (job.cause, job.status, job.error_type) == (Cause.STREAM_ADMISSION_ERROR, 200, "BadRequestError")
    assert decode.observed == [(400, "bad", False)]
    stream.feed(REFUSAL)  # the rest passes unread
    stream.finish()
    assert len(rig.queue.jobs) == 1 and len(rig.traces.decisions) == 1


def test_a_stream_that_ends_before_its_first_event_is_whole_is_judged_on_what_came() -> None:
    decode = FakeDecode(None)
    rig = Rig(decode=decode)
    stream = StreamJudge(rig.judge, exchange(stream=True))
    stream.feed(b'data: {"choices": [{"text": "hi"}]}')
    assert not stream.decided
    stream.finish()
    assert stream.decided and rig.traces.decisions == [("no_release", "admitted", "not_released")]
    assert decode.observed == []  # not an error event: nothing learnt of D


def test_a_responses_stream_skips_its_lead_events_and_others_do_not() -> None:
    lead = b'event: response.created\ndata: {"type": "response.created"}\n\n'
    for route, decided in (("/v1/responses", False), ("/v1/completions", True)):
        rig = Rig()
        stream = StreamJudge(rig.judge, exchange(stream=True, route=route))
        stream.feed(lead)
        assert stream.decided is decided, route
    rig = Rig()
    stream = StreamJudge(rig.judge, exchange(stream=True, route="/v1/responses"))
    stream.feed(lead + REFUSAL)
    assert [job.cause for job in rig.queue.jobs] == [Cause.STREAM_ADMISSION_ERROR]


@pytest.mark.parametrize(
    ("event", "told"),
    [
        (Event(failure=NoAnswer.CONNECT_REFUSED), [(NoAnswer.CONNECT_REFUSED, None, False)]),
        (Event(failure=NoAnswer.INJECTED, answer=429), []),  # the sidecar's own answer: D said nothing
        (Event(failure=NoAnswer.CLIENT_GONE_BEFORE_FORWARD), []),
        (Event(failure=NoAnswer.RESET_AFTER_SEND, started=True), []),  # D answered 200, then broke
        (Event(failure=NoAnswer.RESET_AFTER_SEND, started=True, closing=True), [(200, None, True)]),
        (Event(status=200), []),
        (Event(status=200, closing=True), [(200, None, True)]),
        (Event(status=299), []),
        (Event(status=300, error_message="moved"), [(300, "moved", False)]),
        (Event(status=400, error_message="bad"), [(400, "bad", False)]),
    ],
    ids=[
        "unreachable",
        "injected",
        "client-gone",
        "cut-stream",
        "cut-closing-stream",
        "2xx",
        "2xx-closing",
        "last-2xx",
        "3xx",
        "4xx",
    ],
)
def test_what_each_event_tells_of_d(
    event: Event, told: list[tuple[NoAnswer | int, str | None, bool]]
) -> None:
    decode = FakeDecode(None)
    Rig(decode=decode).judge.judge(exchange(), event)
    assert decode.observed == told


CLOSING_HEAD = Event(status=200, stream=True, closing=True, pending=True)


def test_a_closing_streams_head_tells_d_at_once_and_its_first_event_decides() -> None:
    """A 200 stream's head that says ``Connection: close`` tells D's state when it arrives, and
    decides nothing (the exchange stays at D, unjudged); the stream's events then tell only what
    they show themselves, however the stream is judged."""
    refused = FakeDecode(None)
    rig = Rig(decode=refused)
    made = exchange(stream=True)
    rig.judge.forwarded(made)
    assert rig.judge.judge(made, CLOSING_HEAD) is None
    assert refused.observed == [(200, None, True)]
    assert not made.decided and rig.inflight.may_be_read(made.key) and rig.traces.decisions == []
    StreamJudge(rig.judge, made).feed(REFUSAL)
    assert refused.observed == [(200, None, True), (400, "bad", False)]
    assert [job.cause for job in rig.queue.jobs] == [Cause.STREAM_ADMISSION_ERROR]
    ended = FakeDecode(None)
    rig = Rig(decode=ended)
    made = exchange(stream=True)
    rig.judge.judge(made, CLOSING_HEAD)
    stream = StreamJudge(rig.judge, made)
    stream.feed(b'data: {"choices": [{"text": "hi"}]}')
    stream.finish()
    assert ended.observed == [(200, None, True)]
    cut = FakeDecode(None)
    rig = Rig(decode=cut)
    made = exchange(stream=True)
    rig.judge.judge(made, CLOSING_HEAD)
    StreamJudge(rig.judge, made).reset()
    assert cut.observed == [(200, None, True)]
    assert rig.traces.decisions == [("ambiguous", "reset_after_send", "not_released")]


def test_a_streams_head_without_news_of_d_tells_nothing_and_decides_nothing() -> None:
    decode = FakeDecode(None)
    rig = Rig(decode=decode)
    made = exchange(stream=True)
    assert rig.judge.judge(made, Event(status=200, stream=True, pending=True)) is None
    assert decode.observed == [] and not made.decided and rig.traces.decisions == []
    assert rig.sample("kvr_not_released_total", outcome="no_release", cause="admitted") == 0


def test_a_stream_whose_error_event_ends_unterminated_is_judged_on_that_event() -> None:
    decode = FakeDecode(None)
    rig = Rig(decode=decode)
    stream = StreamJudge(rig.judge, exchange(stream=True))
    stream.feed(REFUSAL.rstrip(b"\n"))  # no blank line: the event never ended before the stream did
    assert not stream.decided
    stream.finish()
    [job] = rig.queue.jobs
    assert (job.cause, job.error_type) == (Cause.STREAM_ADMISSION_ERROR, "BadRequestError")
    assert decode.observed == [(400, "bad", False)]


def test_router_mode_releases_its_own_aborts_and_leaves_ds_answers_only_to_a_decode_sidecar() -> None:
    # router_policy() is called here, not read from ROUTER: each of its defaults is under test.
    for policy, answers_released in ((router_policy(), True), (router_policy(decode_releases=True), False)):
        rig = Rig()
        refused = rig.judge.judge(exchange(policy, request_id="refused"), Event(status=400))
        assert (refused.outcome, refused.cause) == (
            (Outcome.RELEASE, Cause.REJECTED_4XX)
            if answers_released
            else (Outcome.NO_RELEASE, Cause.DELEGATED)
        )
        other = release_params({**V033, "remote_request_id": "aborted"})
        aborted = rig.judge.judge(
            exchange(policy, request_id="aborted", params=other),
            Event(failure=NoAnswer.CLIENT_GONE_AFTER_FORWARD),
        )
        assert (aborted.outcome, aborted.cause) == (Outcome.RELEASE, Cause.CLIENT_GONE_AFTER_FORWARD)
        expected = ["refused", "aborted"] if answers_released else ["aborted"]
        assert [job.request_id for job in rig.queue.jobs] == expected


def test_router_mode_counts_ds_answers_under_the_decode_leg() -> None:
    metrics = Metrics(CollectorRegistry())
    policy = router_policy()
    policy.decode_answered(metrics, 503, 0.25)
    policy.decode_failed(metrics, NoAnswer.HEADER_TIMEOUT)
    registry = metrics.registry
    assert registry.get_sample_value("kvr_leg_latency_seconds_count", {"leg": "decode"}) == 1
    assert registry.get_sample_value("kvr_leg_failures_total", {"leg": "decode", "cause": "status_5xx"}) == 1
    assert (
        registry.get_sample_value("kvr_leg_failures_total", {"leg": "decode", "cause": "header_timeout"}) == 1
    )


def _router_rejection(rig: Rig, prefilled_ago: float | None) -> list[ReleaseJob]:
    """A router-mode 400 for a request P answered ``prefilled_ago`` seconds ago (None: unknown)."""
    at = None if prefilled_ago is None else time.monotonic() - prefilled_ago
    rig.judge.judge(exchange(ROUTER, prefilled_at=at), Event(status=400))
    return rig.queue.jobs


@pytest.mark.parametrize(
    ("settings", "decode"),
    [
        ({"vllm_version": "0.33.0"}, FakeDecode(None)),  # the configured release: a 30 s lease
        ({}, FakeDecode("0.33.0")),  # D's release as observed
        ({"p_hold_seconds": 30.0}, FakeDecode(None)),  # the configured hold
    ],
)
def test_a_router_skips_a_release_past_ps_lease(
    settings: dict[str, Any], decode: FakeDecode, caplog: pytest.LogCaptureFixture
) -> None:
    rig = Rig(decode=decode, **settings)
    with caplog.at_level(logging.DEBUG, logger="sidecar"):
        assert _router_rejection(rig, prefilled_ago=100.0) == []
    [record] = [r for r in caplog.records if "lease" in r.getMessage()]
    assert record.getMessage() == "P's lease on the blocks has passed; not released"
    assert record.request_id == "req-1"  # type: ignore[attr-defined]
    assert rig.sample("kvr_not_released_total", outcome="no_release", cause="lease_expired") == 1
    assert rig.traces.decisions == [("release", "rejected_4xx", "lease_expired")]


def test_a_router_releases_when_ps_release_has_no_lease_or_the_answer_time_is_unknown() -> None:
    never_expires = Rig(vllm_version="0.9.2")  # before 0.10.0 P holds the blocks until released
    [job] = _router_rejection(never_expires, prefilled_ago=1000.0)
    assert job.deadline - job.detected_at == pytest.approx(30.0)  # release_deadline, not the lease
    unknown = Rig(p_hold_seconds=5.0)
    [job] = _router_rejection(unknown, prefilled_ago=None)
    assert job.deadline - job.detected_at == pytest.approx(30.0)
    assert unknown.sample("kvr_not_released_total", outcome="no_release", cause="lease_expired") == 0


def test_a_routers_release_is_not_retried_past_the_lease_less_its_margin() -> None:
    short = Rig(p_hold_seconds=5.0)  # margin: a tenth of the lease
    before = time.monotonic()
    [job] = _router_rejection(short, prefilled_ago=0.0)
    assert before + 4.5 <= job.deadline <= time.monotonic() + 4.5
    long = Rig(p_hold_seconds=100.0)  # margin at most 5 s: the lease ends after release_deadline
    [job] = _router_rejection(long, prefilled_ago=0.0)
    assert job.deadline - job.detected_at == pytest.approx(30.0)
    almost = Rig(p_hold_seconds=100.0)
    [job] = _router_rejection(almost, prefilled_ago=80.0)  # 15 s of the 95 left: the lease bounds it
    assert job.deadline - job.detected_at == pytest.approx(15.0, abs=0.5)
    assert _router_rejection(Rig(p_hold_seconds=100.0), prefilled_ago=95.5) == []  # inside the margin
