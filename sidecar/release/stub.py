"""The ``off`` and ``dry-run`` strategies: nothing is sent.

``off`` classifies and counts rejections (result ``off``); ``dry-run``
records every job it would send as well (result ``dry_run``: for roll-outs
and the demo). Neither checks anything nor frees P's blocks.
"""

from __future__ import annotations

import collections
from typing import Literal

from sidecar.release.base import JobResult, ReleaseJob


class StubReleaser:
    """``off`` or ``dry-run`` (see the module docstring); ``keep``: jobs a dry-run remembers."""

    frees = False
    checked = False
    keeps_raw = False

    def __init__(self, name: Literal["off", "dry-run"] = "dry-run", keep: int = 1000) -> None:
        self.name: str = name
        self._result = JobResult.OFF if name == "off" else JobResult.DRY_RUN
        kept = keep if name == "dry-run" else 0  # off records nothing
        self.recorded: collections.deque[ReleaseJob] = collections.deque(maxlen=kept)

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

    async def release(self, job: ReleaseJob) -> JobResult:
        self.recorded.append(job)
        return self._result
