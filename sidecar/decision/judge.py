"""The one home of the release decision: from what happened to a request to what P gets.

``Judge.judge`` is the one entry: it takes an exchange and its ``Event``
(D's status with its error type and message, a stream's first event, or the
failure that kept an answer from arriving; whether the response had started;
the sidecar's own answer) and returns the ``Decision``. It first tells D's
state what the event shows of D (``DecodeWatch.observe``: a failure to reach
it, an error answer, ``Connection: close``); a 200 stream's head
(``Event.pending``) stops there, so D's state learns of its ``Connection:
close`` when it arrives and the stream's first event decides. Otherwise it
decides, in this order, each step counted:

1. ``classify`` (a pure table): release, ambiguous or not;
2. the exchange's ``Policy``: router mode releases what it aborted itself,
   and with ``decode_releases`` leaves D's answers to the decode sidecar;
3. ``release_ambiguous``;
4. an answer a gateway or mesh may retry on another decode pod
   (``retried_statuses``, sidecar mode only): never released behind, since that
   pod's D reads the blocks (``sidecar.retries``);
5. the in-flight veto: parameters another request forwarded to D, which D
   may be reading, are never released;
   in router mode, a release that would reach P after its lease (counted
   from P's answer, ``sidecar.release.hold.release_by``) is skipped
   (``kvr_not_released_total{cause="lease_expired"}``): P has freed the
   blocks itself and would only log an error for an unknown request;
6. D's own fix (``sidecar.decision.coverage``): a rejection D's engine
   releases itself goes to the pipeline as ``covered`` (recorded, never
   sent), unless D cannot notify now; one D may or may not have released is
   sent only after D's own notifications would have gone out;
7. the job is handed to the pipeline, which never blocks.

``InFlight`` is the veto's memory: the parameters of requests at D, and of
those D admitted within the lease. ``StreamJudge`` applies the same decision
to a 200 stream from its first SSE event (``sidecar.decision.sse``) while the
bytes pass through.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Hashable
from typing import Protocol

import msgspec

from sidecar import retries
from sidecar.classify import (
    D_FAILURES,
    FAILURE_STATUS,
    ROUTER_RELEASES,
    Cause,
    Decision,
    Event,
    NoAnswer,
    Outcome,
    classify,
    stream_event,
)
from sidecar.config import Config
from sidecar.decision.coverage import engine_covers, engine_may_cover, fix_version
from sidecar.decision.policy import Policy
from sidecar.decision.sse import FirstEventScanner
from sidecar.observability.metrics import Metrics
from sidecar.observability.tracing import Tracing
from sidecar.params import ReleaseParams
from sidecar.release.base import ReleaseJob
from sidecar.release.hold import lease_seconds, release_by
from sidecar.release.pipeline import Pipeline

log = logging.getLogger("sidecar.proxy")

#: ``kvr_not_released_total{cause}`` of a router-mode release P's lease made pointless.
LEASE_EXPIRED = "lease_expired"
#: ``kvr_not_released_total{outcome}`` of a rejection left to a retry on another decode pod.
RETRYABLE = "retryable"


class DecodeWatch(Protocol):
    """D as the judge watches it: its release, whether its engine can notify now, and what the
    request path saw of it (cheap: read on every rejection)."""

    def version(self) -> str | None:
        """D's vLLM release (P runs the same), when known."""

    def can_notify(self) -> bool:
        """D's engine could send its own release now (alive, not shutting down, a KV connector)."""

    def observe(self, signal: NoAnswer | int, message: str | None = None, *, closing: bool = False) -> None:
        """What the request path saw of D (``sidecar.decode.state.DecodeState.observe``)."""


class Judged(msgspec.Struct, frozen=True):
    """What the judge made of one exchange (at most once): its decision, and whether its
    parameters went to a release that frees them (then a client's retry with them is refused)."""

    decision: Decision
    spent: bool = False


class Case(Protocol):
    """One exchange as the judge reads it (``sidecar.proxy.context.Exchange``)."""

    request_id: str
    route: str
    params: ReleaseParams | None
    policy: Policy
    raw_params: bytes | None
    body_request_id: str | None
    data_parallel_rank: int | None
    request_id_generated: bool
    prefilled_at: float | None
    judged: Judged | None
    vouched: bool

    @property
    def sent(self) -> object | None:
        """Set once the request went to D's socket (None: it never left the sidecar)."""

    @property
    def key(self) -> tuple[str, str]:
        """The parameters' identity: (P engine, the id P knows the request by)."""

    @property
    def decided(self) -> bool:
        """The judge has decided it (``judged`` is set)."""


class InFlight:
    """Keys of parameters forwarded to D that D may still read: in flight, or admitted recently.

    The veto (step 5): a replayed, failing copy of a live request through this sidecar never
    frees its blocks. Every admitted request is remembered, so that table is written once per
    request: a plain dict of deadlines in the order they were set (every entry lives for the same
    ``ttl``, so that is also the order they expire in), which costs a fraction of a general map
    with expiry.
    """

    def __init__(self, size: int, ttl: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._live: dict[Hashable, int] = {}
        # Key -> the clock's time it stops being read, oldest first; at most ``size`` of them.
        self._admitted: dict[Hashable, float] = {}
        self._size, self._ttl, self._clock = size, ttl, clock

    def forwarded(self, key: Hashable) -> None:
        self._live[key] = self._live.get(key, 0) + 1

    def finished(self, key: Hashable, admitted: bool) -> None:
        count = self._live.get(key, 0) - 1
        if count > 0:
            self._live[key] = count
        else:
            self._live.pop(key, None)
        if admitted:
            self.admitted(key)

    def admitted(self, key: Hashable) -> None:
        """D may read these parameters for the next ``ttl`` seconds (it admitted, or is aborting, one)."""
        admitted, now = self._admitted, self._clock()
        admitted.pop(key, None)  # set again: now the newest
        admitted[key] = now + self._ttl
        # The oldest entry goes once expired or over the size: one per call, so the expired
        # drain as new ones come, and the table never holds more than ``size``.
        oldest = next(iter(admitted))
        if admitted[oldest] <= now or len(admitted) > self._size:
            del admitted[oldest]

    def may_be_read(self, key: Hashable) -> bool:
        """Another request with these parameters is at D, or D admitted one within the lease."""
        if self._live.get(key, 0) > 0:
            return True
        until = self._admitted.get(key)
        return until is not None and self._clock() < until


class Judge:
    """Decides and hands over (see the module docstring)."""

    def __init__(
        self,
        config: Config,
        pipeline: Pipeline,
        metrics: Metrics,
        inflight: InFlight,
        decode: DecodeWatch,
        tracing: Tracing,
    ) -> None:
        self._config = config
        self._pipeline = pipeline
        self._metrics = metrics
        self._inflight = inflight
        self._decode = decode
        self._tracing = tracing
        # Whether a release frees P's blocks: off, dry-run and a --dry-run free nothing, so a
        # client's retry with the same parameters is never refused and answers never change.
        self.release_frees = pipeline.releaser.frees
        self.retried = retries.parse(config.retried_statuses)

    def forwarded(self, exchange: Case) -> None:
        """The exchange's parameters are on their way to D: D may read them until it is judged."""
        self._inflight.forwarded(exchange.key)

    def judge(self, exchange: Case, event: Event) -> Decision | None:
        """The one entry: what ``event`` means for the exchange's parameters, handed over; None
        for a stream's head (``Event.pending``), which only tells D's state what it shows."""
        news = _news(event)
        if news is not None:  # D's state first: the decision reads it (D's own fix)
            self._decode.observe(*news, closing=event.closing)
        if event.pending:  # the stream's first event decides
            return None
        decision = exchange.policy.decide(classify(event), event)
        exchange.judged = Judged(decision)
        if exchange.params is None:
            self._traced(decision, "no_params")
            return decision
        releases = decision.releases(self._config.release_ambiguous)
        left = releases and exchange.policy.retried_elsewhere(_answer(event), self.retried)
        key = exchange.key
        if exchange.sent is not None:
            # Left to a retry on another pod: D there may read them, as if admitted here.
            self._inflight.finished(key, admitted=left or not releases)
        if left:
            self._metrics.not_released_for(RETRYABLE, decision.cause.value).inc()
            self._traced(decision, "retryable")
            return decision
        if not releases:
            self._metrics.not_released_for(decision.outcome.value, decision.cause.value).inc()
            self._traced(decision, "not_released")
            return decision
        lease_end = self._lease_end(exchange)
        if lease_end is not None and time.monotonic() >= lease_end:
            self._metrics.not_released_for(Outcome.NO_RELEASE.value, LEASE_EXPIRED).inc()
            log.info(
                "P's lease on the blocks has passed; not released", extra={"request_id": exchange.request_id}
            )
            self._traced(decision, LEASE_EXPIRED)
            return decision
        if self._inflight.may_be_read(key):
            # Another request with these parameters is at D or was admitted: D may be reading them.
            self._metrics.not_released_for(Outcome.NO_RELEASE.value, "params_in_use").inc()
            log.warning(
                "rejected request reuses parameters D may be reading; not released",
                extra={"request_id": exchange.request_id},
            )
            self._traced(decision, "params_in_use")
            return decision
        if exchange.sent is not None and decision.cause in ROUTER_RELEASES:
            # The sidecar aborted a request D had: D's handler cleans up, or D is still reading. A
            # later request with these parameters must not be released meanwhile.
            self._inflight.admitted(key)
        self._metrics.rejections_for(decision.cause.value).inc()
        job = self._job(exchange, decision, event)
        if lease_end is not None and lease_end < job.deadline:
            job = job.but(deadline=lease_end)  # not retried past the lease either
        queued = self._pipeline.submit(job)
        exchange.judged = Judged(decision, spent=self.release_frees and exchange.policy.spends_params)
        self._traced(decision, "queued" if queued else "duplicate")
        return decision

    def _job(self, exchange: Case, decision: Decision, event: Event) -> ReleaseJob:
        assert exchange.params is not None
        now = time.monotonic()
        job = ReleaseJob(
            request_id=exchange.request_id,
            request_id_generated=exchange.request_id_generated and exchange.policy.spends_params,
            route=exchange.route,
            body_request_id=exchange.body_request_id,
            params=exchange.params,
            cause=decision.cause,
            status=event.status if event.answer is None else event.answer,
            error_type=event.first.error_type if event.first is not None else event.error_type,
            injected=event.failure is NoAnswer.INJECTED,
            detected_at=now,
            deadline=now + self._config.release_deadline,
            raw_params=exchange.raw_params,
            data_parallel_rank=exchange.data_parallel_rank,
            trace_context=self._tracing.job_context() if self._tracing.enabled else None,
            decode_reachable=decision.cause is not Cause.UNREACHABLE,
            vouched=exchange.vouched,
        )
        return self._covered(job, now)

    def _covered(self, job: ReleaseJob, now: float) -> ReleaseJob:
        """D's own fix: covered jobs are recorded, never sent; a job D may have released waits."""
        if not self._pipeline.releaser.checked:
            return job  # off and dry-run record every rejection as it is: no checks
        version = fix_version(self._config.vllm_version or self._decode.version())
        if version is None or not self._decode.can_notify():
            return job  # unknown release, or D cannot send now: the sidecar releases
        if engine_covers(version, job):
            return job.but(covered=True)
        if engine_may_cover(version, job):
            # Both releasing could strand the request at P (a count between D's readers' messages):
            # the sidecar's goes after D's would have gone.
            return job.but(not_before=now + self._config.may_cover_delay)
        return job

    def _lease_end(self, exchange: Case) -> float | None:
        """Router mode: when a release would reach P past its lease; None without a lease."""
        if exchange.prefilled_at is None:
            return None
        lease = lease_seconds(
            self._config.vllm_version or self._decode.version(), self._config.p_hold_seconds
        )
        return None if lease is None else release_by(exchange.prefilled_at, lease)

    def _traced(self, decision: Decision, release: str) -> None:
        if self._tracing.enabled:
            self._tracing.decided(decision.outcome.value, decision.cause.value, release)


class StreamJudge:
    """Judges a 200 stream from its first SSE event while the bytes pass through. What the
    stream's head showed of D (``Connection: close``) was told when it arrived
    (``sidecar.proxy.handler.Forwarder``), so its events here carry only what they show themselves."""

    __slots__ = ("_exchange", "_judge", "_scanner")

    def __init__(self, judge: Judge, exchange: Case) -> None:
        self._judge, self._exchange = judge, exchange
        self._scanner = FirstEventScanner(skip_lead=exchange.route == "/v1/responses")

    @property
    def decided(self) -> bool:
        """The stream is judged: the rest of it needs no look."""
        return self._exchange.decided

    def feed(self, chunk: bytes) -> None:
        if self._exchange.decided:
            return
        first = self._scanner.feed(chunk)
        if first is not None:
            self._judged(stream_event(first))

    def finish(self) -> None:
        if not self._exchange.decided:
            self._judged(stream_event(self._scanner.finish()))

    def reset(self) -> None:
        """D broke the stream before its first event ended: D may have admitted it."""
        if not self._exchange.decided:
            self._judged(Event(failure=NoAnswer.RESET_AFTER_SEND, started=True))

    def _judged(self, event: Event) -> None:
        self._judge.judge(self._exchange, event)


def _answer(event: Event) -> int | None:
    """The status the client sees, while a proxy in front may still retry it: none once the
    response started (a 200 stream cut later); the sidecar's own answer when it chose one."""
    if event.started:
        return None
    if event.answer is not None:
        return event.answer
    if event.failure is not None:
        return FAILURE_STATUS.get(event.failure)
    return event.status


def _news(event: Event) -> tuple[NoAnswer | int, str | None] | None:
    """What ``event`` tells of D itself: a failure to reach it before any answer, an error
    answer (or a stream's error event), or an answer that said ``Connection: close``."""
    if event.failure is not None:
        if event.failure in D_FAILURES and not event.started:
            return event.failure, None
        return (200, None) if event.closing else None  # a 2xx stream that said so, then broke
    first = event.first
    if first is not None and first.error_code is not None:
        return first.error_code, first.error_message
    status = event.status or 0
    if not 200 <= status < 300 or event.closing:
        return status, event.error_message
    return None
