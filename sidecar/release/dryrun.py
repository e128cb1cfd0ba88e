"""The ``dry-run`` strategy: records every job it would send (for roll-outs and the demo)."""

from __future__ import annotations

import collections

from sidecar.release.base import ReleaseJob, Result


class DryRunReleaser:
    name = "dry-run"

    def __init__(self, keep: int = 1000, *, frees: bool = False, keeps_raw: bool = False) -> None:
        # Tests record in place of a live strategy: the proxy then behaves as for that strategy.
        self.frees, self.keeps_raw = frees, keeps_raw
        self.recorded: collections.deque[ReleaseJob] = collections.deque(maxlen=keep)

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None

    def ready(self) -> bool:
        return True

    def target(self, job: ReleaseJob) -> str:
        return ""  # nothing is ever contacted

    def detail(self) -> dict[str, object]:
        return {}

    async def release(self, job: ReleaseJob) -> Result:
        self.recorded.append(job)
        return Result.DRY_RUN
