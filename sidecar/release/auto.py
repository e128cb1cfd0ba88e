"""The ``auto`` release strategy: D's control endpoint when D serves it, NIXL otherwise.

At start and every ``--auto-probe-interval`` seconds it probes the plugin's
authenticated ``GET /kv_release/v1/health``: 200 selects the ``control`` path,
404/405 (no plugin, or a plugin without a token), 401/403 (token mismatch) or
503 (no engine) select ``nixl``; an unreachable D leaves the choice as it was.
Per job:

* ``job.decode_reachable`` false (the judge saw D unreachable): NIXL (the control
  endpoint lives in D);
* path ``control``: the ``http`` strategy. When the attempt certainly did not
  reach D's engine (connect error, 404, 401, 403) the same job goes to NIXL at
  once, and an answer saying the route is gone or refuses us switches the path
  until the next probe. When it may have reached the engine (timeout, 5xx,
  connection lost) the job is pinned to the control path: its retries never
  switch to NIXL, since a partial release from D followed by the sidecar's
  own notification can leave P's counter short (P counts one reader's messages per rank);
* path ``nixl``: the ``nixl`` strategy.

The judge decides what reaches the strategy (D's own fix, vLLM 0.21.0+, is
applied before: ``sidecar.decision.coverage``). ``kvr_releases_total`` counts every job under the strategy
label ``auto``; ``kvr_auto_releases_total{path,result}`` says which path
served it, ``kvr_release_path{path}`` is 1 for the current choice, and the
sub-strategies' own ``kvr_control_*`` and ``kvr_nixl_*`` series count too.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Literal, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge

from sidecar.config import Config
from sidecar.exceptions import Reason
from sidecar.release.base import (
    JobResult,
    LiveReleaser,
    PermanentReleaseError,
    ReleaseJob,
    RetryableReleaseError,
)
from sidecar.release.http import NOT_DELIVERED, ControlUnreachable, HttpReleaser, Probe
from sidecar.ttlmap import TTLMap

log = logging.getLogger(__name__)

Path = Literal["control", "nixl"]
PATHS: tuple[Path, ...] = ("control", "nixl")
PINNED_SIZE = 65536


class ControlPath(Protocol):
    """What auto needs of the ``http`` strategy (``HttpReleaser``): a releaser that can probe."""

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    def ready(self) -> bool: ...

    async def release(self, job: ReleaseJob) -> JobResult: ...

    async def rehearse(self, job: ReleaseJob) -> JobResult: ...

    def target(self, job: ReleaseJob) -> str: ...

    async def probe(self) -> Probe: ...


class AutoMetrics:
    """``kvr_release_path`` and ``kvr_auto_releases_total``."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        reg = registry if registry is not None else CollectorRegistry()
        self.path = Gauge(
            "kvr_release_path", "1 for the path auto releases through now.", ["path"], registry=reg
        )
        self.releases = Counter(
            "kvr_auto_releases",
            "Jobs finished by the auto strategy, by path and result.",
            ["path", "result"],
            registry=reg,
        )


class AutoReleaser:
    """``Releaser`` choosing between the control endpoint and NIXL (see the module docstring)."""

    name = "auto"
    frees = True
    checked = True
    keeps_raw = True

    def __init__(
        self,
        config: Config,
        decode_version: Callable[[], Awaitable[str | None]],
        registry: CollectorRegistry | None = None,
        *,
        control: ControlPath | None = None,
        nixl: LiveReleaser | None = None,
    ) -> None:
        self._interval = config.auto_probe_interval
        self.control: ControlPath = control or HttpReleaser(config, decode_version, registry)
        if nixl is None:
            from sidecar.release.nixl import NixlReleaser  # ZMQ and NIXL only when chosen

            nixl = NixlReleaser(config, decode_version, registry)
        self.nixl = nixl
        self.metrics = AutoMetrics(registry)
        self.path: Path = "nixl"  # until a probe finds the control endpoint
        self.probed: Probe | Literal["not_yet"] = "not_yet"
        self._nixl_started = False
        # Jobs that must stay on the control endpoint until their deadline (``release_deadline``).
        self._pinned: TTLMap[tuple[str, str], bool] = TTLMap(PINNED_SIZE, config.release_deadline)
        self._task: asyncio.Task[None] | None = None
        self._set_path("nixl")

    # --- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        await self.control.start()
        try:
            await self.nixl.start()
            self._nixl_started = True
        except Exception as exc:  # NIXL missing or broken: the control path can still release
            log.error("auto: the NIXL strategy did not start (%s); only D's control endpoint releases", exc)
        await self.probe()
        self._task = asyncio.create_task(self._probe_loop(), name="kvr-auto-probe")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        await self.control.close()
        await self.nixl.close()

    def ready(self) -> bool:
        return self.control.ready() if self.path == "control" else self.nixl.ready()

    def target(self, job: ReleaseJob) -> str:
        if self._via_nixl(job):
            return self.nixl.target(job)
        return self.control.target(job)

    def _via_nixl(self, job: ReleaseJob) -> bool:
        return job.key not in self._pinned and (not job.decode_reachable or self.path == "nixl")

    def detail(self) -> dict[str, object]:
        """For ``/readyz``: the path in use and why."""
        return {
            "strategy": self.name,
            "path": self.path,
            "probe": self.probed,
            "control_ready": self.control.ready(),
            "nixl_ready": self.nixl.ready(),
        }

    # --- choosing --------------------------------------------------------------------------

    async def probe(self) -> Probe:
        """Ask D's control endpoint whether it serves us, and choose the path from the answer."""
        result = await self.control.probe()
        self.probed = result
        if result == "present":
            self._set_path("control", result)
        elif result != "unreachable":  # D down says nothing about its plugin: keep the choice
            self._set_path("nixl", result)
        return result

    async def _probe_loop(self) -> None:
        while True:
            await asyncio.sleep(self._interval)
            try:
                await self.probe()
            except Exception:  # a probe must never end the loop
                log.exception("auto: probing the control endpoint failed")

    def _set_path(self, path: Path, why: str = "start") -> None:
        if path != self.path or why == "start":
            level = logging.INFO if path == "control" or why in ("start", "absent") else logging.WARNING
            log.log(level, "auto: releasing through %s (control endpoint: %s)", path, why)
        self.path = path
        for name in PATHS:
            self.metrics.path.labels(name).set(1 if name == path else 0)

    # --- one job ---------------------------------------------------------------------------

    async def release(self, job: ReleaseJob) -> JobResult:
        return await self._release(job, rehearse=False)

    async def rehearse(self, job: ReleaseJob) -> JobResult:
        """The path a release would take, and that path's own checks; nothing is sent."""
        return await self._release(job, rehearse=True)

    async def _release(self, job: ReleaseJob, rehearse: bool) -> JobResult:
        pinned = job.key in self._pinned
        if self._via_nixl(job):
            return await self._through_nixl(job, rehearse)
        try:
            result = await (self.control.rehearse(job) if rehearse else self.control.release(job))
        except ControlUnreachable:
            if pinned:
                raise  # an earlier attempt may have reached the engine: stay on this path
            self._count("control", Reason.UNREACHABLE)
            return await self._through_nixl(job, rehearse)
        except PermanentReleaseError as exc:
            if exc.reason in NOT_DELIVERED and not pinned:
                self._set_path("nixl", exc.reason)
                return await self._through_nixl(job, rehearse)
            self._count("control", JobResult.REFUSED.value)
            raise
        except RetryableReleaseError:
            self._pin(job)
            self._count("control", "error")
            raise
        self._pinned.pop(job.key, None)
        self._count("control", result.value)
        return result

    async def _through_nixl(self, job: ReleaseJob, rehearse: bool) -> JobResult:
        if not self._nixl_started or not self.nixl.ready():
            self._count("nixl", JobResult.REFUSED.value)
            raise PermanentReleaseError(
                "NIXL is not available and D's control endpoint cannot help", Reason.NO_PATH
            )
        try:
            result = await (self.nixl.rehearse(job) if rehearse else self.nixl.release(job))
        except PermanentReleaseError:
            self._count("nixl", JobResult.REFUSED.value)
            raise
        except RetryableReleaseError:
            self._count("nixl", "error")
            raise
        self._count("nixl", result.value)
        return result

    def _pin(self, job: ReleaseJob) -> None:
        self._pinned[job.key] = True

    def _count(self, path: Path, result: str) -> None:
        self.metrics.releases.labels(path, result).inc()
