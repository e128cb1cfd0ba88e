"""End to end on loopback: P simulator, vLLM-D simulator, and the sidecar's NIXL release.

Real NIXL agents (UCX), real ZMQ side channels, real uvicorn servers. A
prefill request pins blocks on P; the decode request goes through the
sidecar to D. When D rejects it before admission the sidecar frees the
blocks on every P rank; when D admits it, D frees them and the sidecar
sends nothing. P's ``/stats`` is the ground truth for both sides.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.support.runner import Sidecar
from tests.support.sims import cluster, p_stats, prefill, wait_stats
from tests.support.until import until

pytestmark = pytest.mark.nixl


def decode(sc: Sidecar, request_id: str, params: dict[str, Any], prompt_words: int) -> httpx.Response:
    body = {
        "model": "sim-prefill",
        "prompt": " ".join(["tok"] * prompt_words),
        "max_tokens": 4,
        "kv_transfer_params": params,
    }
    return httpx.post(sc.url + "/v1/completions", json=body, headers={"x-request-id": request_id}, timeout=10)


@pytest.mark.parametrize(
    ("version", "tp", "pp"),
    [
        ("0.34.0", 2, 1),
        ("0.34.0", 2, 2),
        ("0.33.0", 1, 1),
        ("0.33.0", 2, 1),
        ("0.33.0", 4, 1),
        ("0.33.0", 2, 2),
        ("0.21.0", 2, 1),
        ("0.11.0", 2, 1),
    ],
)
def test_rejected_request_frees_every_rank(version: str, tp: int, pp: int) -> None:
    # Before 0.21.0 nothing in D releases a rejection; from 0.21.0 a handler rejection is D's own
    # to release, so this test uses one that happens before the handler (validation) everywhere.
    with cluster(version, tp, pp) as (p, _d, sc):
        params = prefill(p, "rej-1")
        assert p_stats(p)["pinned_requests"] == 1
        response = httpx.post(
            sc.url + "/v1/completions",
            json={"model": "sim-prefill", "max_tokens": "x", "prompt": "tok", "kv_transfer_params": params},
            headers={"x-request-id": "rej-1"},
        )
        assert response.status_code == 400
        after = wait_stats(p, lambda s: s["pinned_requests"] == 0)
        assert after["freed_by_notification"] == 1
        assert after["blocks_in_use"] == 0
        assert after["notifs_per_rank"] == [1] * (tp * pp)
        assert after["notifs_unknown"] == 0 and after["listener_alive"]
        sc.settle()
        assert sc.sample("kvr_releases_total", strategy="nixl", result="sent") == 1


def test_admitted_request_is_freed_by_d_and_sidecar_sends_nothing() -> None:
    with cluster("0.33.0", 2) as (p, _d, sc):
        params = prefill(p, "ok-1")
        response = decode(sc, "ok-1", params, prompt_words=5)
        assert response.status_code == 200
        after = wait_stats(p, lambda s: s["pinned_requests"] == 0)
        sc.settle()
        assert after["notifs_per_rank"] == [1, 1]  # D's notification only
        assert after["notifs_unknown"] == 0
        assert sc.sample("kvr_releases_total", strategy="nixl", result="sent") == 0


def test_engine_fix_covers_handler_rejections_and_sidecar_covers_the_rest() -> None:
    with cluster("0.33.0", 2) as (p, _d, sc):
        covered = prefill(p, "fix-1")
        response = decode(sc, "fix-1", covered, prompt_words=80)  # prompt too long: raised in D's handler
        assert response.status_code == 400
        wait_stats(p, lambda s: s["pinned_requests"] == 0)
        uncovered = prefill(p, "fix-2")
        response = httpx.post(
            sc.url + "/v1/completions",
            json={"model": "sim-prefill", "max_tokens": "x", "prompt": "t", "kv_transfer_params": uncovered},
            headers={"x-request-id": "fix-2"},
        )
        assert response.status_code == 400  # validation, before D's handler: D's fix does not see it
        after = wait_stats(p, lambda s: s["pinned_requests"] == 0)
        sc.settle()
        assert after["notifs_per_rank"] == [2, 2]  # one per request per rank: no duplicate
        assert after["notifs_unknown"] == 0
        assert sc.sample("kvr_releases_total", strategy="nixl", result="covered_by_engine") == 1
        assert sc.sample("kvr_releases_total", strategy="nixl", result="sent") == 1


@pytest.mark.parametrize(("origin", "covered"), [("pre_handler", 0), ("handler", 3)])
def test_a_503_before_ds_handler_is_released_and_one_from_it_is_ds_own(origin: str, covered: int) -> None:
    """vLLM answers a completion request 503 before its handler only from the elastic-EP scaling
    middleware (untyped, ``{"error": ...}``): D's cleanup never sees it and the sidecar releases
    it. A 503 typed "ServiceUnavailableError" comes from the handler (a retryable error D's engine
    sent back, 0.33.0+), which D's engine frees itself. With ``retried_statuses`` empty (nothing in
    front retries on another D) every 503 may be released."""
    fail = {"fail_first": 3, "fail_status": 503, "fail_origin": origin}
    with cluster("0.34.0", 1, d_settings=fail, retried_statuses=()) as (p, _d, sc):
        for n in range(3):
            params = prefill(p, f"busy-{n}")
            assert decode(sc, f"busy-{n}", params, prompt_words=4).status_code == 503
        after = wait_stats(p, lambda s: s["pinned_requests"] == 0)
        sc.settle()
        assert (after["freed_by_notification"], after["freed_by_expiry"], after["notifs_unknown"]) == (
            3,
            0,
            0,
        )
        assert sc.sample("kvr_releases_total", strategy="nixl", result="covered_by_engine") == covered
        assert sc.sample("kvr_releases_total", strategy="nixl", result="sent") == 3 - covered


def test_before_the_fix_release_handler_rejections_too() -> None:
    with cluster("0.13.0", 2) as (p, _d, sc):
        params = prefill(p, "old-1")
        assert decode(sc, "old-1", params, prompt_words=80).status_code == 400
        after = wait_stats(p, lambda s: s["pinned_requests"] == 0)
        assert after["notifs_per_rank"] == [1, 1]


def test_target_outside_allowlist_is_never_contacted() -> None:
    with cluster("0.33.0", 2, prefill_allow=("10.0.0.0/8",)) as (p, _d, sc):
        params = prefill(p, "deny-1")
        body = {"model": "sim-prefill", "max_tokens": "x", "prompt": "t", "kv_transfer_params": params}
        assert httpx.post(sc.url + "/v1/completions", json=body).status_code == 400
        sc.settle()
        assert sc.sample("kvr_releases_total", strategy="nixl", result="refused") == 1
        current = p_stats(p)
        assert current["handshakes_served"] == 0  # no connection attempted
        assert current["pinned_requests"] == 1


def test_replays_of_released_parameters_are_refused_and_release_once() -> None:
    # Once the release is sent P may reuse the blocks: a retry carrying the same parameters
    # must not reach D (it would decode from whatever the blocks hold by then).
    with cluster("0.11.0", 2) as (p, d, sc):
        params = prefill(p, "dup-1")
        body = {"model": "sim-prefill", "max_tokens": "x", "prompt": "t", "kv_transfer_params": params}
        first = httpx.post(sc.url + "/v1/completions", json=body, headers={"x-request-id": "dup-1"})
        assert first.status_code == 400
        for _ in range(2):
            again = httpx.post(sc.url + "/v1/completions", json=body, headers={"x-request-id": "dup-1"})
            assert again.status_code == 409
            error = again.json()["error"]
            assert error["type"] == "ConflictError" and error["code"] == 409
            assert error["param"] == "kv_transfer_params" and "prefill again" in error["message"]
            assert again.headers["x-request-id"] == "dup-1"
        after = wait_stats(p, lambda s: s["pinned_requests"] == 0)
        sc.settle()
        assert after["notifs_per_rank"] == [1, 1]
        assert len(httpx.get(d.url + "/sim/log").json()) == 1  # D saw only the first
        assert sc.sample("kvr_released_replays_total", action="refused") == 2
        assert sc.sample("kvr_releases_total", strategy="nixl", result="sent") == 1
        assert sc.sample("kvr_requests_total", route="completions", status_class="4xx") == 3


def test_a_replay_while_the_release_is_still_retrying_is_refused() -> None:
    # P's side channel is not there: the job retries until its deadline. A retry meanwhile
    # would have D read blocks the job may free any moment.
    with cluster("0.33.0", 1, release_deadline=3.0) as (p, d, sc):
        params = prefill(p, "busy-1")
        params["remote_port"] = params["remote_port"] + 1 if params["remote_port"] < 65535 else 1
        body = {"model": "sim-prefill", "max_tokens": "x", "prompt": "t", "kv_transfer_params": params}
        assert httpx.post(sc.url + "/v1/completions", json=body).status_code == 400
        failed = ("unreachable", "handshake_timeout", "timeout", "retryable")
        attempts = "kvr_release_attempts_total"
        until(lambda: sum(sc.sample(attempts, strategy="nixl", reason=o) for o in failed) >= 1)
        assert sc.sample("kvr_releases_total", strategy="nixl", result="failed") == 0  # still retrying
        assert httpx.post(sc.url + "/v1/completions", json=body).status_code == 409
        assert len(httpx.get(d.url + "/sim/log").json()) == 1


def test_a_release_the_strategy_refused_leaves_the_parameters_usable() -> None:
    # Nothing was sent (a newer vLLM release, refused by setting), so P still holds the blocks: a
    # retry goes to D.
    with cluster("0.33.0", 2, vllm_version="0.99.0", unknown_vllm="refuse") as (p, d, sc):
        params = prefill(p, "keep-1")
        body = {"model": "sim-prefill", "max_tokens": "x", "prompt": "t", "kv_transfer_params": params}
        assert httpx.post(sc.url + "/v1/completions", json=body).status_code == 400
        until(lambda: sc.sample("kvr_releases_total", strategy="nixl", result="refused") == 1)
        assert decode(sc, "keep-1", params, prompt_words=5).status_code == 200  # D read them
        assert len(httpx.get(d.url + "/sim/log").json()) == 2
        assert sc.sample("kvr_released_replays_total", action="refused") == 0


def test_before_0_13_a_request_id_the_sidecar_made_up_is_never_sent_to_p() -> None:
    # P's id derives from the X-Request-Id the router sent P; without one at the sidecar, the id
    # the sidecar generates for D was never P's: a notification for it would be "unrecognized"
    # (0.10.1-0.12.0) or crash P's engine (0.9.x-0.10.0).
    with cluster("0.11.0", 2) as (p, _d, sc):
        params = prefill(p, "anon-1")
        body = {"model": "sim-prefill", "max_tokens": "x", "prompt": "t", "kv_transfer_params": params}
        response = httpx.post(sc.url + "/v1/completions", json=body)  # no x-request-id
        assert response.status_code == 400 and len(response.headers["x-request-id"]) == 32
        until(lambda: sc.sample("kvr_releases_total", strategy="nixl", result="refused") == 1)
        assert sc.sample("kvr_release_attempts_total", strategy="nixl", reason="no_request_id") == 1
        current = p_stats(p)
        assert current["notifs_unknown"] == 0 and current["handshakes_served"] == 0
        assert current["pinned_requests"] == 1  # left to P's timeout, as without the sidecar


def test_before_0_13_an_oversized_body_without_request_id_is_not_sent_to_p() -> None:
    # The same rule on the sidecar's own refusals: a 413 releases the parameters found at the
    # body's end, but not under an id the sidecar made up.
    with cluster("0.11.0", 2, max_body_bytes=4096) as (p, _d, sc):
        params = prefill(p, "big-1")
        body = {"model": "sim-prefill", "prompt": "tok " * 2000, "kv_transfer_params": params}
        response = httpx.post(sc.url + "/v1/completions", json=body)  # no x-request-id
        assert response.status_code == 413
        until(lambda: sc.sample("kvr_releases_total", strategy="nixl", result="refused") == 1)
        assert sc.sample("kvr_release_attempts_total", strategy="nixl", reason="no_request_id") == 1
        assert p_stats(p)["notifs_unknown"] == 0 and p_stats(p)["pinned_requests"] == 1


def test_p_restarted_with_new_agents_gets_a_new_handshake() -> None:
    with cluster("0.33.0", 2) as (p, _d, sc):
        body = {"model": "sim-prefill", "max_tokens": "x", "prompt": "t"}
        first = prefill(p, "rs-1")
        httpx.post(sc.url + "/v1/completions", json={**body, "kv_transfer_params": first})
        wait_stats(p, lambda s: s["pinned_requests"] == 0)
        assert httpx.post(p.url + "/sim/restart-agents").status_code < 300
        second = prefill(p, "rs-2")
        httpx.post(sc.url + "/v1/completions", json={**body, "kv_transfer_params": second})
        after = wait_stats(p, lambda s: s["pinned_requests"] == 0)
        assert after["freed_by_notification"] == 2
        assert after["handshakes_served"] >= 2


def test_release_for_a_request_p_no_longer_holds_is_harmless() -> None:
    # P's lease is long enough for D's read of the second request on a loaded machine (0.5 s was
    # not, beside a full test run), short enough to wait out for the first.
    with cluster("0.33.0", 2, lease=3.0) as (p, _d, sc):
        params = prefill(p, "gone-1")
        wait_stats(p, lambda s: s["freed_by_expiry"] == 1)  # P's lease ran out first
        body = {"model": "sim-prefill", "max_tokens": "x", "prompt": "t", "kv_transfer_params": params}
        assert httpx.post(sc.url + "/v1/completions", json=body).status_code == 400
        after = wait_stats(p, lambda s: s["notifs_unknown"] == 2)  # one per rank, logged by P
        assert after["listener_alive"] and after["worker_errors"] == 0
        sc.settle()
        assert sc.sample("kvr_releases_total", strategy="nixl", result="sent") == 1
        again = prefill(p, "after-1")  # P still serves and frees normally
        assert decode(sc, "after-1", again, prompt_words=5).status_code == 200
        wait_stats(p, lambda s: s["freed_by_notification"] == 1)


def test_replayed_failing_copy_of_an_admitted_request_is_not_released() -> None:
    with cluster("0.33.0", 2) as (p, _d, sc):
        params = prefill(p, "live-1")
        assert decode(sc, "live-1", params, prompt_words=5).status_code == 200  # D admitted and read it
        wait_stats(p, lambda s: s["pinned_requests"] == 0)
        body = {"model": "sim-prefill", "max_tokens": "x", "prompt": "t", "kv_transfer_params": params}
        assert httpx.post(sc.url + "/v1/completions", json=body).status_code == 400
        sc.settle()
        assert sc.sample("kvr_not_released_total", outcome="no_release", cause="params_in_use") == 1
        assert sc.sample("kvr_releases_total", strategy="nixl", result="sent") == 0
        assert p_stats(p)["notifs_unknown"] == 0


def test_a_newer_vllm_refused_by_setting_sends_nothing() -> None:
    with cluster("0.33.0", 2, vllm_version="0.99.0", unknown_vllm="refuse") as (p, _d, sc):
        params = prefill(p, "unk-1")
        body = {"model": "sim-prefill", "max_tokens": "x", "prompt": "t", "kv_transfer_params": params}
        assert httpx.post(sc.url + "/v1/completions", json=body).status_code == 400
        sc.settle()
        assert sc.sample("kvr_releases_total", strategy="nixl", result="refused") == 1
        current = p_stats(p)
        assert current["handshakes_served"] == 0 and current["pinned_requests"] == 1


def test_a_newer_vllm_reported_by_d_is_released_and_said_once(caplog: pytest.LogCaptureFixture) -> None:
    """D's /version names a release no one has made; P speaks 0.34.0's wire (the newest known)."""
    caplog.set_level("WARNING", logger="sidecar.version")
    with cluster("0.34.0", 2, 2, d_version="0.99.0") as (p, _d, sc):
        for n in (1, 2):
            params = prefill(p, f"new-{n}")
            body = {"model": "sim-prefill", "max_tokens": "x", "prompt": "t", "kv_transfer_params": params}
            assert httpx.post(sc.url + "/v1/completions", json=body).status_code == 400
        after = wait_stats(p, lambda s: s["pinned_requests"] == 0)
        assert after["notifs_per_rank"] == [2] * 4 and after["notifs_unknown"] == 0
        sc.settle()
        assert sc.sample("kvr_releases_total", strategy="nixl", result="sent") == 2
        assert sc.sample("kvr_vllm_unknown_version_info", version="0.99.0") == 1
        warned = [r for r in caplog.records if "newer than every release" in r.getMessage()]
        assert len(warned) == 1 and "0.99.0" in warned[0].getMessage()


DOWN = {"release_deadline": 4.0, "release_retry_max": 0.25}


def test_p_down_retries_then_gives_up_at_deadline() -> None:
    with cluster("0.33.0", 1, **DOWN) as (p, _d, sc):
        assert sc.app.runtime is not None
        params = prefill(p, "down-1")
        params["remote_port"] = params["remote_port"] + 1 if params["remote_port"] < 65535 else 1
        body = {"model": "sim-prefill", "max_tokens": "x", "prompt": "t", "kv_transfer_params": params}
        response = httpx.post(sc.url + "/v1/completions", json=body)
        assert response.status_code == 400
        # The client never waits for the release: it has its answer while the job still retries,
        # which it does until its deadline (4 s) less one backoff (at most 0.25 s), a margin of
        # 3.75 s for the loaded machine between the answer and this look.
        assert sc.app.runtime.pipeline.live == 1
        assert sc.sample("kvr_releases_total", strategy="nixl", result="failed") == 0
        sc.settle()
        assert sc.sample("kvr_releases_total", strategy="nixl", result="failed") == 1
        assert sc.sample("kvr_release_attempts_total", strategy="nixl", reason="ok") == 0
