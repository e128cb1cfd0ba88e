"""The ``nixl`` release strategy: free P's blocks by speaking D's part of the NIXL protocol.

For one job (the judge has decided it is the sidecar's to send, and whether it
is a dry run): learn P's vLLM release (``--vllm-version``, else D's ``GET
/version`` through D's state; P and D run the same release), check
``kv_transfer_params`` against it, check P's endpoint against the allowlist,
handshake with every P worker (or reuse the cached handshake), refuse a P
process that is not the one that held the blocks (``sidecar.nixl.lineage``)
and send each worker one notification (``<id>:1``; ``<id>`` for 0.9.0). Nothing is ever sent by trial:
an unknown or contradicted release is refused before any socket exists.
Failures are typed (``sidecar.nixl``); the pipeline retries the retryable
ones, and the ranks already notified for a job are remembered so a retry
never notifies a rank twice.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import zmq.asyncio
from prometheus_client import CollectorRegistry

from sidecar.config import Config
from sidecar.exceptions import Reason
from sidecar.network.allowlist import Allowlist
from sidecar.nixl import EngineMismatch, HandshakeTimeout, NixlError, PRestarted
from sidecar.nixl.handshake import HandshakeCache, HandshakeClient, PeerSet, Rank, Target, TargetCheck
from sidecar.nixl.lineage import Lineage
from sidecar.nixl.messages import notification
from sidecar.nixl.metrics import NixlMetrics
from sidecar.nixl.peer import NixlPeer
from sidecar.nixl.versions import WireProfile, check_params, engine_request_id
from sidecar.observability.tracing import OFF, Tracing
from sidecar.release.base import (
    PermanentReleaseError,
    ReleaseError,
    ReleaseJob,
    Result,
    RetryableReleaseError,
    Verdict,
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
        self._check = check or TargetCheck(Allowlist(config.prefill_allow))
        self.peer = peer or NixlPeer()
        self._context: zmq.asyncio.Context | None = None
        self._client: HandshakeClient | None = None
        self._cache = HandshakeCache(config.handshake_cache_size, config.handshake_cache_ttl)
        self._lineage = Lineage(config.handshake_cache_size, config.handshake_cache_ttl)
        self._inflight: dict[str, asyncio.Future[PeerSet]] = {}
        # A job's retries end at its deadline, ``release_deadline`` after it was made.
        self._progress: TTLMap[tuple[str, str], _Progress] = TTLMap(PROGRESS_SIZE, config.release_deadline)
        self._profiles: dict[str, WireProfile | None] = {}
        self._logged: dict[str, float] = {}
        self._loopback_warned: set[str] = set()
        self._last_sweep = time.monotonic()

    # --- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        if not self._check.allowlist:
            log.warning(
                "--prefill-allow is empty: the nixl strategy contacts no P and releases nothing; "
                "list P's side-channel hosts (e.g. 10.0.0.0/8:5600-5700)"
            )
        self._context = zmq.asyncio.Context()
        self._client = HandshakeClient(self._context, self._config.handshake_timeout)
        await self.peer.start()

    async def close(self) -> None:
        await self._drop(self._cache.drain(), "shutdown")
        await self.peer.close()
        if self._context is not None:
            self._context.destroy(linger=0)
            self._context = None

    def ready(self) -> bool:
        return self._context is not None and self.peer.ready()

    def detail(self) -> dict[str, object]:
        return {}

    def target(self, job: ReleaseJob) -> str:
        """P's side channel, as the parameters name it."""
        params = job.params
        return f"{(params.remote_host or '').lower()}:{params.remote_port}"

    # --- one job ---------------------------------------------------------------------------

    async def release(self, job: ReleaseJob) -> Result:
        started = time.perf_counter()
        try:
            result, path = await self._release(job)
        except PermanentReleaseError as exc:
            self.metrics.releases.labels("refused").inc()
            self.metrics.refused.labels(exc.reason).inc()
            self._log_refusal(job, exc)
            raise
        except RetryableReleaseError as exc:
            self.metrics.releases.labels("error").inc()
            self.metrics.errors.labels(exc.reason).inc()
            # Debug only: the job's one outcome line comes from the pipeline, not one per retry.
            log.debug(
                "nixl release failed, will retry", extra=_fields(job, reason=exc.reason, error=str(exc))
            )
            raise
        self.metrics.releases.labels(result.value).inc()
        if result is Result.SENT:
            self.metrics.release_seconds.labels(path).observe(time.perf_counter() - started)
        return result

    async def _release(self, job: ReleaseJob) -> tuple[Result, str]:
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
        if job.dry_run:  # every check the live release makes before it connects to P
            target = await self._check.target(host, sorted({profile.port(port, tp) for _, tp in ranks}))
            self._warn_loopback(target)
            return Result.WOULD_SEND, "dry_run"
        progress = self._progress_of(engine_id, request_id)
        if unsafe and progress.attempted:
            raise PermanentReleaseError(
                "vLLM < 0.10.1: a send was attempted once, never twice", Reason.UNSAFE_RETRY
            )
        await self._sweep()
        endpoint = (host, port)
        generation = params.remote_registration_generation
        peers = self._cache.get(engine_id)
        path = "warm"
        if peers is None or not peers.serves(generation, endpoint, ranks):
            self.metrics.cache.labels("miss").inc()
            peers, path = await self._connect(engine_id, generation, endpoint, profile, ranks), "cold"
        else:
            self.metrics.cache.labels("hit").inc()
        message = notification(profile, request_id)
        progress.attempted = True
        failed = await self._send(peers, ranks, message, progress, job)
        if failed and not unsafe:
            # A cached agent may be gone (P restarted): handshake again, once.
            await self._invalidate(peers, "send_failure")
            peers = await self._connect(engine_id, generation, endpoint, profile, ranks)
            failed = await self._send(peers, ranks, message, progress, job)
        if failed:
            raise NixlError(f"notification to {len(failed)} P worker(s) failed: {failed[0]}")
        self._progress.pop((engine_id, request_id), None)
        return Result.SENT, path

    async def _send(
        self, peers: PeerSet, ranks: list[Rank], message: bytes, progress: _Progress, job: ReleaseJob
    ) -> list[str]:
        """Notify the ranks not notified yet; the failures' texts. Refused (``p_restarted``) when
        ``peers`` is a P process that came after the one that held the job's blocks."""
        agents = frozenset(peers.agents.values())
        why = self._lineage.refusal(peers.endpoint, agents, job.detected_at)
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
        self.metrics.notifications.labels("ok").inc(len(todo) - len(errors))
        if errors:
            self.metrics.notifications.labels("error").inc(len(errors))
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
            self._profiles[text] = WireProfile.for_version(text)
        profile = self._profiles[text]
        if profile is None:
            raise PermanentReleaseError(
                f"vLLM {text!r} is not a release this sidecar knows (0.9.0-0.33.0; "
                "pre-releases only where the wire format did not change)",
                Reason.UNKNOWN_VERSION,
            )
        return profile

    # --- handshakes and the cache ----------------------------------------------------------

    async def _connect(
        self,
        engine_id: str,
        generation: int | None,
        endpoint: tuple[str, int],
        profile: WireProfile,
        ranks: list[Rank],
    ) -> PeerSet:
        pending = self._inflight.get(engine_id)
        if pending is not None:
            peers = await asyncio.shield(pending)
            if peers.serves(generation, endpoint, ranks):
                return peers
        future: asyncio.Future[PeerSet] = asyncio.get_running_loop().create_future()
        self._inflight[engine_id] = future
        try:
            # The span is made on the event loop around the await; the NIXL thread never sees it.
            with self._tracing.handshake_span(engine_id, endpoint, ranks):
                peers = await self._handshake(engine_id, generation, endpoint, profile, ranks)
        except asyncio.CancelledError:
            # The job that began it was cancelled (its deadline): the jobs waiting on this
            # handshake get a timeout they retry, not a cancellation that is not theirs.
            future.set_exception(HandshakeTimeout("the handshake was abandoned by the job that began it"))
            future.exception()
            raise
        except BaseException as exc:
            future.set_exception(exc)
            future.exception()  # retrieved here; waiters re-raise it
            raise
        else:
            future.set_result(peers)
            return peers
        finally:
            if self._inflight.get(engine_id) is future:
                del self._inflight[engine_id]

    async def _handshake(
        self,
        engine_id: str,
        generation: int | None,
        endpoint: tuple[str, int],
        profile: WireProfile,
        ranks: list[Rank],
    ) -> PeerSet:
        assert self._client is not None, "start() first"
        # The old set's agents go first: NIXL names an agent by the remote, so a re-add of
        # the same P worker followed by removing the old entry would remove the new one.
        for old in self._cache.take(engine_id):
            if old.engine_id != engine_id:
                await self._drop([old], "ttl")
            else:
                await self._drop([old], "generation" if old.generation != generation else "replaced")
        host, base_port = endpoint
        target = await self._check.target(host, sorted({profile.port(base_port, tp) for _, tp in ranks}))
        self._warn_loopback(target)
        started = time.perf_counter()
        try:
            try:
                replies = await self._client.fetch(target, profile, ranks)
            except ReleaseError as exc:
                if exc.verdict is Verdict.DOWN:
                    self._lineage.lost(endpoint)
                raise
            wrong = sorted({meta.engine_id for meta in replies.values() if meta.engine_id != engine_id})
            if wrong:
                raise EngineMismatch(f"{host}:{base_port} serves engine {wrong[0]!r}, not {engine_id!r}")
            agents: dict[Rank, str] = {}
            try:
                for rank in ranks:
                    agents[rank] = await self.peer.add_remote(replies[rank].agent_metadata)
            except ReleaseError:
                await self.peer.remove_remote(list(agents.values()))
                raise
        except ReleaseError:
            self.metrics.handshakes.labels("error").inc()
            raise
        self.metrics.handshakes.labels("ok").inc()
        self.metrics.handshake_seconds.observe(time.perf_counter() - started)
        peers = PeerSet(engine_id, generation, endpoint, agents)
        self._lineage.seen(endpoint, agents.values())
        await self._drop(self._cache.put(peers), "lru")
        return peers

    async def _invalidate(self, peers: PeerSet, reason: str) -> None:
        if self._cache.pop(peers.engine_id, peers) is not None:
            await self._drop([peers], reason)

    async def _drop(self, entries: list[PeerSet], reason: str) -> None:
        self.metrics.engines.set(len(self._cache))
        if not entries:
            return
        self.metrics.evictions.labels(reason).inc(len(entries))
        if self.peer.ready():
            await self.peer.remove_remote([name for entry in entries for name in entry.agents.values()])

    async def _sweep(self) -> None:
        now = time.monotonic()
        if now - self._last_sweep >= min(self._config.handshake_cache_ttl, 60.0):
            self._last_sweep = now
            await self._drop(self._cache.expire(), "ttl")
            self._progress.expire()

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

    def _warn_loopback(self, target: Target) -> None:
        if not target.loopback:
            return
        self.metrics.loopback.inc()
        now = time.monotonic()
        last = self._logged.get("loopback", -LOOPBACK_LOG_INTERVAL)
        if target.host in self._loopback_warned or now - last < LOOPBACK_LOG_INTERVAL:
            return
        if len(self._loopback_warned) < 1024:
            self._loopback_warned.add(target.host)
        self._logged["loopback"] = now
        log.warning(
            "P's remote_host %r is a loopback address: P may have left VLLM_NIXL_SIDE_CHANNEL_HOST "
            "at its default (localhost); the sidecar contacts its own host",
            target.host,
        )


def _fields(job: ReleaseJob, **extra: str) -> dict[str, str]:
    return {
        "engine": job.params.remote_engine_id or "",
        "request_id": job.request_id,
        "cause": job.cause,
        **extra,
    }
