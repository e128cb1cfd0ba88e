"""The seam between the request path and the release strategies.

A ``ReleaseJob`` is what the proxy hands over when it has decided that P's
blocks for a request must be freed. A ``Releaser`` turns one job into the
messages that free them. Strategies raise ``RetryableReleaseError`` for a
failure worth retrying until the job's deadline (P unreachable, handshake
timeout, NIXL error) and ``PermanentReleaseError`` for one that retrying
cannot fix (target not allowed, unsupported vLLM release); the pipeline
owns retries, de-duplication and metrics.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any, Protocol

import msgspec

from sidecar.classify import Cause
from sidecar.exceptions import PermanentReleaseError, ReleaseError, RetryableReleaseError, TargetHealth
from sidecar.params import ReleaseParams


class JobResult(StrEnum):
    """The ``result`` label of ``kvr_releases_total``: one per finished job."""

    SENT = "sent"  # the strategy delivered every message
    DRY_RUN = "dry_run"  # recorded, nothing sent, nothing checked (--release dry-run)
    WOULD_SEND = "would_send"  # every check of the strategy passed; nothing sent (--dry-run)
    OFF = "off"  # releases disabled
    DUPLICATE = "duplicate"  # the ledger saw this (engine, request) already
    COVERED_BY_ENGINE = "covered_by_engine"  # D's own fix releases it (vLLM 0.21.0+)
    REFUSED = "refused"  # permanent: allowlist, unsupported release, bad target
    FAILED = "failed"  # retries exhausted at the deadline
    DROPPED = "dropped"  # evicted from a full queue


class ReleaseJob(msgspec.Struct, frozen=True, kw_only=True):
    """One request whose P blocks must be freed.

    ``detected_at`` and ``deadline`` are ``time.monotonic()`` values; after the
    deadline P frees the blocks itself (lease/timeout), so sending is pointless.
    ``status`` and ``error_type`` describe D's answer when there was one, so a
    strategy can tell whether D's own fix (vLLM 0.21.0+) already released it.
    """

    request_id: str  # the x-request-id seen by D (pre-0.13.0 P derives its id from it)
    # The sidecar made ``request_id`` up (the client sent none): P never saw it, so before
    # 0.13.0 P's id cannot be derived from it (a notification for a made-up id would be
    # "unrecognized" at best, and crash 0.9.x-0.10.0 engines).
    request_id_generated: bool = False
    route: str  # one of the inspected routes (sidecar.config.INSPECTED_ROUTES)
    body_request_id: str | None = None  # the body's request_id (pre-0.13.0 /v1/responses id)
    params: ReleaseParams
    cause: Cause
    status: int | None = None
    error_type: str | None = None
    injected: bool = False
    detected_at: float
    deadline: float
    # The request's span context (sidecar.observability.tracing) when tracing is on: kvr.release is its child.
    trace_context: Any = None
    # kv_transfer_params exactly as they came (JSON): the http strategy hands D's engine every
    # field, also those a newer vLLM appends and ``KVTransferParams`` does not know.
    raw_params: bytes | None = None
    # The request's ``X-data-parallel-rank`` (vLLM routes it to that engine core): the http
    # strategy's release goes to the same rank.
    data_parallel_rank: int | None = None
    # D's engine releases it itself (vLLM 0.21.0+ and D able to notify): recorded, never sent.
    covered: bool = False
    # Not sent before this time.monotonic() value: D may have notified P itself, and the
    # sidecar's notification must not land between D's readers' messages.
    not_before: float = 0.0
    # Whether D answered at all (``auto`` cannot use D's control endpoint for a D it could not reach).
    decode_reachable: bool = True
    # The parameters are P's own: P's answer to the router's prefill leg, or parameters the router
    # hop signed (``trust hmac``) or sent with its token (``trust token``). Their ranks are P's
    # topology; a client's own claim is checked against what such parameters proved.
    vouched: bool = False

    def but(self, **changes: Any) -> ReleaseJob:
        """This job with ``changes``."""
        return msgspec.structs.replace(self, **changes)

    @property
    def x_request_id(self) -> str:
        """The X-Request-Id P may have seen: empty when the sidecar made it up."""
        return "" if self.request_id_generated else self.request_id

    @property
    def key(self) -> tuple[str, str]:
        """De-duplication key: (P engine, id P knows the request by)."""
        return (self.params.remote_engine_id, self.params.remote_request_id or self.request_id)


class Releaser(Protocol):
    """A release strategy. One instance per process; the pipeline calls it from its workers."""

    name: str
    frees: bool  # a release frees P's blocks (off, dry-run and a --dry-run free nothing)
    # D's own fix is checked before a job reaches it (a live strategy and its --dry-run; off and
    # dry-run record every rejection as it is).
    checked: bool
    keeps_raw: bool  # it hands P's parameters on as they came (the proxy keeps the raw JSON)

    async def start(self) -> None:
        """Acquire resources (agents, sockets). Called once in the lifespan."""

    def target(self, job: ReleaseJob) -> str:
        """Where ``job``'s attempts connect (a P side channel, D's control endpoint); the
        pipeline keeps one breaker and one concurrency cap per target."""

    async def close(self) -> None:
        """Release resources. Called once on shutdown, after the queue is flushed."""

    def ready(self) -> bool:
        """Whether the strategy can release now (for /readyz)."""

    def detail(self) -> dict[str, object]:
        """What /readyz shows of the strategy (``{}`` when there is nothing to add)."""

    async def release(self, job: ReleaseJob) -> JobResult:
        """Free P's blocks for ``job`` or raise a ``ReleaseError``.

        Returns ``JobResult.SENT``, ``JobResult.WOULD_SEND`` (``--dry-run``), ``JobResult.DRY_RUN``
        or ``JobResult.OFF``. Jobs D's engine releases itself never reach a strategy
        (``ReleaseJob.covered``).
        """


class LiveReleaser(Releaser, Protocol):
    """A strategy that sends (``nixl``, ``http``, ``auto``): it can also rehearse a release."""

    async def rehearse(self, job: ReleaseJob) -> JobResult:
        """Every check ``release`` makes, nothing sent: ``JobResult.WOULD_SEND`` or a ``ReleaseError``
        (``sidecar.release.dryrun``)."""


__all__ = [
    "JobResult",
    "LiveReleaser",
    "PermanentReleaseError",
    "ReleaseError",
    "ReleaseJob",
    "Releaser",
    "RetryableReleaseError",
    "TargetHealth",
]
