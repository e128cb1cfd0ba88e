"""``--dry-run``: a live strategy wrapped so that it rehearses and never sends.

``DryRun`` runs the wrapped strategy's own checks for each job (its
parameters against the vLLM release, P's id, the target and the allowlist;
for ``http``, what D's control endpoint would answer, from its health route)
and ends the job ``would_send``. It frees nothing, so the proxy never spends
a request's parameters and no answer changes, while the judge still applies
D's own fix as it would for the live strategy (``checked``).
"""

from __future__ import annotations

from sidecar.release.base import JobResult, LiveReleaser, ReleaseJob


class DryRun:
    """``Releaser`` rehearsing ``inner``'s releases (see the module docstring)."""

    frees = False
    checked = True

    def __init__(self, inner: LiveReleaser) -> None:
        self.inner = inner
        self.name = inner.name
        self.keeps_raw = inner.keeps_raw

    async def start(self) -> None:
        await self.inner.start()

    async def close(self) -> None:
        await self.inner.close()

    def ready(self) -> bool:
        return self.inner.ready()

    def target(self, job: ReleaseJob) -> str:
        return self.inner.target(job)

    def detail(self) -> dict[str, object]:
        return self.inner.detail()

    async def release(self, job: ReleaseJob) -> JobResult:
        return await self.inner.rehearse(job)
