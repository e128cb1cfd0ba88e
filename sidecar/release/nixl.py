"""The ``nixl`` release strategy: free P's blocks by speaking D's part of the NIXL protocol.

One job (the judge decided it is the sidecar's to send) reads top to bottom:
the version (P's vLLM release: ``--vllm-version``, else D's ``GET /version``
through D's state; P and D run the same release), the parameters
(``kv_transfer_params`` checked against that release, P's id for the request
derived), the ranks (what the parameters claim; refused when parameters no one
vouched for claim more than P's own named, ``Session.claim``), the peers (P's
workers through the NIXL session, ``sidecar.nixl.session``: cached or
handshaken, rank (0, 0) first and alone until it proves the engine, the target
checked against the allowlist) and the notification (each worker once, ``<id>:1``; ``<id>`` for
0.9.0, refused when P is not the process that held the blocks,
``sidecar.nixl.lineage``). ``rehearse`` stops before the peers, after the
target check (``sidecar.release.dryrun``). Nothing is ever sent by trial: an
unknown or contradicted release is refused before any socket exists.
Failures are typed (``sidecar.nixl``); the pipeline retries the retryable
ones, and the ranks already notified for a job are remembered so a retry
never notifies a rank twice.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry

from sidecar.config import Config
from sidecar.exceptions import Reason
from sidecar.network.allowlist import Allowlist
from sidecar.nixl import NixlError, PRestarted
from sidecar.nixl.handshake import PeerSet, Rank, TargetCheck
from sidecar.nixl.messages import notification
from sidecar.nixl.metrics import NixlMetrics
from sidecar.nixl.peer import NixlPeer
from sidecar.nixl.session import Session
from sidecar.nixl.versions import KNOWN, WireProfile, check_params, engine_request_id, newer_than_known
from sidecar.observability.tracing import OFF, Tracing
from sidecar.release.base import (
    JobResult,
    PermanentReleaseError,
    ReleaseJob,
    RetryableReleaseError,
)
from sidecar.ttlmap import TTLMap

log = logging.getLogger(__name__)

LOG_INTERVAL = 10.0  # at most one refusal warning per reason per interval
LOOPBACK_LOG_INTERVAL = 60.0
PROGRESS_SIZE = 65536


@dataclass(slots=True)
class _Progress:
    """What has been sent for one job, kept until its deadline (retries resume from it)."""

    sent: set[Rank] = field(default_factory=set)
    attempted: bool = False
    agents: frozenset[str] = frozenset()  # the P process the ranks in ``sent`` belong to


class NixlReleaser:
    """``Releaser`` that notifies every P worker over NIXL (see the module docstring)."""

    name = "nixl"
    frees = True
    checked = True
    keeps_raw = False

    def __init__(
        self,
        config: Config,
        decode_version: Callable[[], Awaitable[str | None]],
        registry: CollectorRegistry | None = None,
        *,
        peer: NixlPeer | None = None,
        tracing: Tracing = OFF,
        check: TargetCheck | None = None,
    ) -> None:
        self._config = config
        self._tracing = tracing
        self._decode_version = decode_version
        self.metrics = NixlMetrics(registry)
        check = check or TargetCheck(Allowlist(config.prefill_allow))
        self.session = Session(config, self.metrics, peer or NixlPeer(), check, tracing)
        self.peer = self.session.peer
        # A job's retries end at its deadline, ``release_deadline`` after it was made.
        self._progress: TTLMap[tuple[str, str], _Progress] = TTLMap(PROGRESS_SIZE, config.release_deadline)
        self._profiles: dict[str, WireProfile | None] = {}
        self._logged: dict[str, float] = {}

    # --- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        if not self.session.check.allowlist:
            log.warning(
                "--prefill-allow is empty: the nixl strategy contacts no P and releases nothing; "
                "list P's side-channel hosts (e.g. 10.0.0.0/8:5600-5700)"
            )
        await self.session.start()

    async def close(self) -> None:
        await self.session.close()

    def ready(self) -> bool:
        return self.session.ready()

    def detail(self) -> dict[str, object]:
        return {}

    def target(self, job: ReleaseJob) -> str:
        """P's side channel, as the parameters name it."""
        params = job.params
        return f"{(params.remote_host or '').lower()}:{params.remote_port}"

    # --- one job ---------------------------------------------------------------------------

    async def release(self, job: ReleaseJob) -> JobResult:
        return await self._attempt(job, rehearse=False)

    async def rehearse(self, job: ReleaseJob) -> JobResult:
        """Every check ``release`` makes before it connects to P, the target's included; nothing
        is sent (``sidecar.release.dryrun``)."""
        return await self._attempt(job, rehearse=True)

    async def _attempt(self, job: ReleaseJob, rehearse: bool) -> JobResult:
        started = time.perf_counter()
        try:
            result, path = await self._release(job, rehearse)
        except PermanentReleaseError as exc:
            self.metrics.outcome("refused").inc()
            self.metrics.refused.labels(exc.reason).inc()
            self._log_refusal(job, exc)
            raise
        except RetryableReleaseError as exc:
            self.metrics.outcome("error").inc()
            self.metrics.errors.labels(exc.reason).inc()
            # Debug only: the job's one outcome line comes from the pipeline, not one per retry.
            log.debug(
                "nixl release failed, will retry", extra=_fields(job, reason=exc.reason, error=str(exc))
            )
            raise
        self.metrics.outcome(result.value).inc()
        if result is JobResult.SENT:
            self.metrics.seconds(path).observe(time.perf_counter() - started)
        return result

    async def _release(self, job: ReleaseJob, rehearse: bool) -> tuple[JobResult, str]:
        params = job.params
        engine_id, host, port = params.remote_engine_id, params.remote_host, params.remote_port
        profile = await self._profile()
        problem = check_params(profile, params)
        if problem:
            raise PermanentReleaseError(
                f"kv_transfer_params do not fit vLLM {profile.text}: {problem}", Reason.INCONSISTENT_VERSION
            )
        unsafe = not profile.safe_unknown_id
        if unsafe and not self._config.allow_unsafe_vllm:
            raise PermanentReleaseError(
                f"vLLM {profile.text} crashes P's engine on a notification for an id it no longer "
                "holds; releases need --allow-unsafe-vllm",
                Reason.UNSAFE_VERSION,
            )
        request_id = engine_request_id(profile, params, job.x_request_id, job.route, job.body_request_id)
        if request_id is None:
            raise PermanentReleaseError(
                f"P's id for this request cannot be known on vLLM {profile.text} "
                f"(route {job.route}, x-request-id {job.request_id!r})",
                Reason.NO_REQUEST_ID,
            )
        ranks = profile.ranks(params)
        endpoint = (host, port)
        self.session.claim(engine_id, endpoint, ranks, job.vouched)
        if rehearse:  # every check the live release makes before it connects to P
            await self.session.target(host, sorted({profile.port(port, tp) for _, tp in ranks}))
            return JobResult.WOULD_SEND, "dry_run"
        progress = self._progress_of(engine_id, request_id)
        if unsafe and progress.attempted:
            raise PermanentReleaseError(
                "vLLM < 0.10.1: a send was attempted once, never twice", Reason.UNSAFE_RETRY
            )
        if await self.session.sweep():
            self._progress.expire()
        generation = params.remote_registration_generation
        peers, path = await self.session.peers(engine_id, generation, endpoint, profile, ranks, job.vouched)
        message = notification(profile, request_id)
        progress.attempted = True
        failed = await self._send(peers, ranks, message, progress, job)
        if failed and not unsafe:
            # A cached agent may be gone (P restarted): handshake again, once.
            await self.session.invalidate(peers, "send_failure")
            peers = await self.session.connect(engine_id, generation, endpoint, profile, ranks, job.vouched)
            failed = await self._send(peers, ranks, message, progress, job)
        if failed:
            raise NixlError(f"notification to {len(failed)} P worker(s) failed: {failed[0]}")
        self._progress.pop((engine_id, request_id), None)
        return JobResult.SENT, path

    async def _send(
        self, peers: PeerSet, ranks: list[Rank], message: bytes, progress: _Progress, job: ReleaseJob
    ) -> list[str]:
        """Notify the ranks not notified yet; the failures' texts. Refused (``p_restarted``) when
        ``peers`` is a P process that came after the one that held the job's blocks."""
        agents = frozenset(peers.agents.values())
        why = self.session.lineage.refusal(peers.endpoint, agents, job.detected_at)
        if why is None and progress.sent and progress.agents != agents:
            why = "P restarted between the notifications of this request's ranks"
        if why is not None:
            raise PRestarted(why)
        progress.agents = agents
        todo = [rank for rank in ranks if rank not in progress.sent]
        results = await self.peer.notify_many([(peers.agents[rank], message) for rank in todo])
        errors = []
        for rank, error in zip(todo, results, strict=True):
            if error is None:
                progress.sent.add(rank)
            else:
                errors.append(f"rank {rank}: {error}")
        self.metrics.notified("ok").inc(len(todo) - len(errors))
        if errors:
            self.metrics.notified("error").inc(len(errors))
        return errors

    # --- versions --------------------------------------------------------------------------

    async def _profile(self) -> WireProfile:
        text = self._config.vllm_version or await self._decode_version()
        if not text:
            raise PermanentReleaseError(
                "P's vLLM release is unknown: set --vllm-version (D's GET /version gave nothing)",
                Reason.UNKNOWN_VERSION,
            )
        if text not in self._profiles:
            self._profiles[text] = WireProfile.for_version(text, self._config.unknown_vllm)
        profile = self._profiles[text]
        if profile is None:
            newer = " (unknown_vllm is refuse)" if newer_than_known(text) else ""
            raise PermanentReleaseError(
                f"vLLM {text!r} is not a release this sidecar knows ({KNOWN}; "
                f"pre-releases only where the wire format did not change){newer}",
                Reason.UNKNOWN_VERSION,
            )
        return profile

    # --- job progress ----------------------------------------------------------------------

    def _progress_of(self, engine_id: str, request_id: str) -> _Progress:
        key = (engine_id, request_id)
        progress = self._progress.get(key)
        if progress is None:
            progress = self._progress[key] = _Progress()
        return progress

    # --- logs ------------------------------------------------------------------------------

    def _log_refusal(self, job: ReleaseJob, exc: PermanentReleaseError) -> None:
        now = time.monotonic()
        if now - self._logged.get(exc.reason, -LOG_INTERVAL) >= LOG_INTERVAL:
            self._logged[exc.reason] = now
            log.warning("nixl release skipped: %s", exc, extra=_fields(job, reason=exc.reason))
        else:
            log.debug("nixl release skipped: %s", exc, extra=_fields(job, reason=exc.reason))


def _fields(job: ReleaseJob, **extra: str) -> dict[str, str]:
    return {
        "engine": job.params.remote_engine_id or "",
        "request_id": job.request_id,
        "cause": job.cause,
        **extra,
    }
