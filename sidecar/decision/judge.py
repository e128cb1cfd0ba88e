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

``sidecar.proxy.stream.StreamJudge`` applies the same decision to a 200 stream
from its first SSE event while the bytes pass through.
"""

from __future__ import annotations

import logging
import time
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
)
from sidecar.config import Config
from sidecar.decision.coverage import engine_covers, engine_may_cover, fix_version
from sidecar.decision.inflight import InFlight
from sidecar.decision.policy import Policy
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
