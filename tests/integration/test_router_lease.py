"""Router mode knows when P pinned the blocks: a release past P's lease is skipped and counted.

P's lease is set to 1 s on the simulated P and in the sidecar (``p_hold_seconds``);
D takes its time before refusing the request (``latency``) on the token-in
route, whose handler D's own cleanup does not wrap, so only the router could
release. Past the lease P has freed the blocks itself and a release would only
reach it as a notification for an unknown request.
"""

from __future__ import annotations

import httpx
import pytest

from tests.support.sims import generate, pd, wait_stats

pytestmark = pytest.mark.nixl


def test_a_release_past_ps_lease_is_skipped_and_counted() -> None:
    with pd(p_config={"lease": 1.0}, d_config={"latency": 1.5}, p_hold_seconds=1.0) as ([p], _d, sc):
        response = httpx.post(sc.url + "/inference/v1/generate", json=generate(60), timeout=10)
        assert response.status_code == 400
        after = wait_stats(p, lambda s: s["pinned_requests"] == 0)
        assert after["freed_by_expiry"] == 1 and after["freed_by_notification"] == 0
        sc.settle()
        assert sc.sample("kvr_not_released_total", outcome="no_release", cause="lease_expired") == 1
        assert sc.sample("kvr_releases_total", strategy="nixl", result="sent") == 0
        assert httpx.get(p.url + "/stats").json()["notifs_unknown"] == 0  # nothing reached P late


def test_a_release_within_ps_lease_is_sent() -> None:
    # A lease long enough for a loaded machine: the release is sent at once, well within it.
    with pd(p_config={"lease": 5.0}, d_config={"latency": 0.1}, p_hold_seconds=5.0) as ([p], _d, sc):
        response = httpx.post(sc.url + "/inference/v1/generate", json=generate(60), timeout=10)
        assert response.status_code == 400
        after = wait_stats(p, lambda s: s["pinned_requests"] == 0)
        assert after["freed_by_notification"] == 1 and after["freed_by_expiry"] == 0
        sc.settle()
        assert sc.sample("kvr_not_released_total", outcome="no_release", cause="lease_expired") == 0
        assert sc.sample("kvr_releases_total", strategy="nixl", result="sent") == 1
