"""Router mode, P's answer over ``prefill_answer_limit``: the sidecar reads its end and frees P.

No decode leg is sent for such an answer, so D never reads the blocks P kept
for it; with P's parameters read from the end of its answer the router
releases them at once (real NIXL to the prefill simulator), rather than
leaving them to P's lease.
"""

from __future__ import annotations

import httpx
import pytest

from tests.support.sims import chat, generate, pd, wait_stats

pytestmark = pytest.mark.nixl

LIMIT = 64  # every answer of P is longer


@pytest.mark.parametrize(
    ("route", "body"),
    [("/v1/chat/completions", chat("one two three")), ("/inference/v1/generate", generate(12))],
)
def test_an_answer_over_the_limit_is_a_502_and_p_is_freed_at_once(
    route: str, body: dict[str, object]
) -> None:
    with pd(prefill_answer_limit=LIMIT) as ([p], d, sc):
        response = httpx.post(sc.url + route, json=body, headers={"x-request-id": "big-1"})
        assert response.status_code == 502
        assert f"prefill_answer_limit ({LIMIT} bytes)" in response.json()["error"]["message"]
        after = wait_stats(p, lambda s: s["freed_by_notification"] >= 1 and s["pinned_requests"] == 0)
        assert (after["freed_by_notification"], after["freed_by_expiry"]) == (1, 0)
        assert after["requests_pinned"] == 1  # P did pin it: the release freed something
        assert httpx.get(d.url + "/sim/log").json() == []  # D never had it
        sc.settle()
        assert sc.sample("kvr_releases_total", strategy="nixl", result="sent") == 1
        assert sc.sample("kvr_rejections_total", cause="prefill_answer_too_large") == 1
