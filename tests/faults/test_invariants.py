"""The invariant checker itself: its fate table, and that each invariant can fail.

A checker that never fails proves nothing, so each kind of violation is
provoked on purpose here (a release for a request D admitted, a refused
release, a leaked task, an error logged by the sidecar) and must be reported.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import pytest

from sidecar.release.base import ReleaseJob
from tests.faults.cluster import Backends, scene
from tests.faults.invariants import Fate, Observed, derive_fate
from tests.support.fakes import release_params

pytestmark = pytest.mark.nixl


def _entry(outcome: str, status: int, origin: str | None = None, admitted: bool = False) -> dict[str, Any]:
    return {"outcome": outcome, "status": status, "origin": origin, "admitted": admitted}


@pytest.mark.parametrize(
    ("status", "sidecar_answered", "entry", "ambiguous", "fate"),
    [
        (503, True, None, False, "sidecar"),  # D unreachable
        (413, True, None, False, "sidecar"),  # body over the cap
        (502, True, None, False, "none"),  # reset after sending: D may have it
        (502, True, None, True, "sidecar"),  # ... unless ambiguous outcomes are released
        (504, True, None, False, "none"),
        (0, False, None, False, None),  # the client left: the truth cannot tell
        (200, False, _entry("admitted", 200, admitted=True), False, "d"),
        (200, False, _entry("dropped", 200, admitted=True), True, "d"),
        (504, True, _entry("cancelled", 499, "handler"), False, "d"),  # D's cleanup (0.21.0+)
        (400, False, _entry("rejected", 400, "pre_handler"), False, "sidecar"),
        (400, False, _entry("rejected", 400, "handler"), False, "d"),  # D's own fix
        (502, True, _entry("rejected", 400, "pre_handler"), False, "none"),  # D's answer was lost
        (400, True, _entry("rejected", 400, "pre_handler"), False, "sidecar"),  # D's status, own body
        (200, False, _entry("stream_error", 200, "stream"), False, "sidecar"),
        (200, False, _entry("pending", 0), False, None),
    ],
)
def test_derive_fate(
    status: int, sidecar_answered: bool, entry: dict[str, Any] | None, ambiguous: bool, fate: Fate | None
) -> None:
    observed = Observed("r", "p", status, sidecar_answered)
    assert derive_fate(observed, entry, ambiguous) == fate


def test_a_release_for_an_admitted_request_is_reported(cluster: Backends) -> None:
    """A job submitted behind the proxy's back for a request D admitted: WRONG RELEASE."""
    with scene(cluster, cluster.d.url, "inv-wrong") as s:
        admitted = s.flows.decode(s.sc.url, "admit")
        assert admitted.status == 200
        now = time.monotonic()
        job = ReleaseJob(
            request_id=admitted.request_id,
            route="/v1/completions",
            params=release_params(admitted.params),
            cause="rejected_4xx",
            status=400,
            detected_at=now,
            deadline=now + 10,
        )
        runtime = s.sc.app.runtime
        assert runtime is not None

        async def submit() -> None:
            runtime.metrics.rejections.labels("rejected_4xx").inc()  # as the proxy counts a submission
            runtime.pipeline.submit(job)

        s.sc.server.call(submit())
        with pytest.raises(AssertionError, match="WRONG RELEASE") as failed:
            s.check([s.observe(admitted)], timeout=5)
        assert "unknown ids" in str(failed.value)


def test_a_refused_release_is_reported_lost(cluster: Backends) -> None:
    """P outside the allowlist: the definite rejection is never released: LOST RELEASE."""
    with scene(cluster, cluster.d.url, "inv-lost", prefill_allow=("10.0.0.0/8",)) as s:
        rejected = s.flows.decode(s.sc.url, "reject")
        with pytest.raises(
            AssertionError, match=r"LOST RELEASE: definite rejection, decisions \['refused'\]"
        ):
            s.check([s.observe(rejected, "sidecar")], timeout=2)


def test_a_leaked_task_and_a_logged_error_are_reported(cluster: Backends) -> None:
    """A task left running on the sidecar's loop, and an exception a sidecar logger reports."""
    with scene(cluster, cluster.d.url, "inv-leak") as s:
        holder: list[asyncio.Task[None]] = []

        async def leak() -> None:
            holder.append(asyncio.get_running_loop().create_task(asyncio.sleep(3600), name="leaked"))

        s.sc.server.call(leak())
        try:
            raise RuntimeError("boom")
        except RuntimeError:
            logging.getLogger("sidecar.release").exception("release strategy raised unexpectedly")
        try:
            with pytest.raises(AssertionError) as failed:
                s.check([], timeout=1)
        finally:
            s.sc.server.loop.call_soon_threadsafe(holder[0].cancel)  # type: ignore[union-attr]
        assert "task leak" in str(failed.value) and "leaked" in str(failed.value)
        assert "unhandled error in the sidecar: sidecar.release: release strategy raised" in str(failed.value)
