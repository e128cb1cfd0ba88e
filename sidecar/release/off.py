"""The ``off`` strategy: rejections are classified and counted, nothing is sent."""

from __future__ import annotations

from sidecar.release.base import ReleaseJob, Result


class OffReleaser:
    name = "off"
    frees = False
    keeps_raw = False

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
        return Result.OFF
