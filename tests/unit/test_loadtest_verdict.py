"""The load generator's verdict, percentiles and metric parsing, as tables."""

from __future__ import annotations

from typing import Any

import pytest
from prometheus_client import generate_latest

from sidecar.loadtest.flow import FlowResult
from sidecar.loadtest.probes import PSnapshot, prometheus_snapshot, sidecar_counters_from_text
from sidecar.loadtest.report import deltas, percentiles
from sidecar.loadtest.runner import _idle
from sidecar.loadtest.verdict import Evidence, judge, was_admitted
from sidecar.observability.metrics import Metrics
from sidecar.sim.prefill.metrics import build_registry


def flow(rid: str, outcome: str = "ok", status: int = 200, **extra: Any) -> FlowResult:
    fields: dict[str, Any] = {"p_request_id": f"p-{rid}", "blocks": 2, "decode_status": status, **extra}
    return FlowResult(
        index=0,
        request_id=rid,
        kind="plain",
        stream=False,
        prompt_words=5,
        start=0.0,
        outcome=outcome,
        **fields,
    )


OK, REJ = flow("a"), flow("b", "rejected", 400, error_type="Bad Request")
LOG = {"a": {"admitted": True, "origin": None}, "b": {"admitted": False, "origin": "pre_handler"}}
RECORDS = {"p-a": {"notification_counts": [1, 1], "freed_by": "notification"}, "p-b": None}


@pytest.mark.parametrize(
    ("evidence", "ok", "phrase"),
    [
        (
            Evidence([OK, REJ], "simulator", {"notifs_unknown": 0}, LOG, RECORDS, {"releases.sent": 1}),
            True,
            "",
        ),
        (Evidence([OK], "simulator", {"notifs_unknown": 2}, LOG, RECORDS), False, "wrong or double release"),
        (
            Evidence([OK], "simulator", {"notifs_unknown": 0}, LOG, {"p-a": {"notification_counts": [2, 1]}}),
            False,
            "notified more than once",
        ),
        (
            Evidence([flow("a", "incomplete", detail="cut")], "simulator", {"notifs_unknown": 0}, LOG),
            False,
            "without their tokens",
        ),
        (Evidence([OK, REJ], "simulator", {}, LOG, None, {"releases.sent": 2}), False, "sent 2 releases"),
        # releases that did not happen: P kept the blocks the run is meant to see come back
        (
            Evidence([OK, REJ], "prometheus", {}, None, None, {"releases.sent": 0, "releases.refused": 1}),
            False,
            "1 release(s) refused",
        ),
        (
            Evidence([OK, REJ], "prometheus", {}, None, None, {"releases.failed": 3}),
            False,
            "3 release(s) failed",
        ),
        # A 200 stream that opens with an error is a rejection, not an admitted request without tokens.
        (
            Evidence([OK, flow("s", "stream_rejected", stream_error=400)], "prometheus", {}, None, None),
            True,
            "",
        ),
    ],
)
def test_judge(evidence: Evidence, ok: bool, phrase: str) -> None:
    verdict = judge(evidence)
    assert verdict.ok is ok
    assert phrase in verdict.line
    assert verdict.line.startswith("verdict: PASS" if ok else "verdict: FAIL")


NOT_FOUND = "The model `x` does not exist. Valid aliases: sim-model."
MISMATCH = [flow(f"m{i}", "rejected", 404, error_type="NotFoundError", detail=NOT_FOUND) for i in range(19)]
INJECTED = [flow(f"i{i}", "rejected", 503, injected=True) for i in range(4)]


@pytest.mark.parametrize(
    ("flows", "share", "ok", "line"),
    [
        # Nothing admitted: every flow D saw was refused (the model names differ), some injected.
        (
            [*MISMATCH, *INJECTED],
            0.1,
            False,
            "verdict: FAIL - D admitted none of the 23 flow(s); D rejected 19 of 23 (83%, over "
            "--max-rejected-share 10%): 404 model not found (P serves 'x', D 'sim-model')",
        ),
        # Admitted requests, but D's own rejections over the share.
        (
            [*[OK] * 10, *MISMATCH[:3], REJ],
            0.2,
            False,
            "verdict: FAIL - D rejected 4 of 14 (29%, over --max-rejected-share 20%): mostly 404 model "
            "not found (P serves 'x', D 'sim-model') (3)",
        ),
        # Injected rejections do not count against D; D's own are within the share.
        ([*[OK] * 10, *INJECTED, REJ], 0.1, True, "verdict: PASS"),
        # P refused everything: nothing reached D.
        (
            [flow("p", "p_refused", 0, prefill_status=503, detail="Not enough KV cache blocks")] * 3,
            0.1,
            False,
            "verdict: FAIL - D admitted none of the 3 flow(s): P answered 503 (Not enough KV cache blocks)",
        ),
        ([], 0.1, False, "verdict: FAIL - D admitted none of the 0 flow(s)"),
    ],
)
def test_a_run_that_tests_nothing_fails_naming_the_cause(
    flows: list[FlowResult], share: float, ok: bool, line: str
) -> None:
    evidence = Evidence(flows, "prometheus", {}, max_rejected_share=share, p_model="x", d_model="sim-model")
    verdict = judge(evidence)
    assert verdict.ok is ok
    assert verdict.line == line if not ok else verdict.line.startswith(line)


def test_without_the_simulators_the_gaps_are_said() -> None:
    verdict = judge(Evidence([OK], "prometheus", {}, None, None))
    assert verdict.ok and verdict.unknown_notifications is None
    assert any("unrecognized request" in note for note in verdict.notes)
    assert any("judged from D's answers" in note for note in verdict.notes)


def test_admitted_comes_from_ds_log_when_it_has_the_request() -> None:
    assert was_admitted(flow("a"), LOG)
    assert not was_admitted(flow("x", "rejected", 503), {})  # never reached D
    assert was_admitted(flow("x"), None) and not was_admitted(flow("x", injected=True), None)


def test_percentiles_nearest_rank() -> None:
    assert percentiles([]) == {"p50": None, "p90": None, "p99": None, "max": None}
    values = [i / 1000 for i in range(1, 101)]  # 1..100 ms
    assert percentiles(values) == {"p50": 50.0, "p90": 90.0, "p99": 99.0, "max": 100.0}


VLLM_METRICS = """\
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="1000"} 1.0
# HELP vllm:nixl_num_failed_notifications Number of failed NIXL notifications
# TYPE vllm:nixl_num_failed_notifications counter
vllm:nixl_num_failed_notifications_total{engine="0",model_name="m"} 3.0
"""


def test_a_real_vllm_ps_metrics() -> None:
    snap = prometheus_snapshot(VLLM_METRICS)
    assert snap.usage == 0.25 and snap.blocks_total == 1000 and snap.blocks_in_use == 250
    assert snap.counters == {"vllm:nixl_num_failed_notifications_total": 3.0}
    assert snap.pinned_requests is None and "notifs_unknown" not in snap.counters


def test_the_prefill_simulators_metrics() -> None:
    stats = {
        "blocks_total": 64,
        "blocks_in_use": 16,
        "pinned_requests": 3,
        "listener_alive": True,
        "pinned_block_seconds": 12.5,
        "refused_no_blocks": 2,
        "handshakes_served": 1,
        "notifs_unknown": 4,
        "notifs_malformed": 0,
        "notifs_heartbeat": 0,
        "worker_errors": 0,
        "requests_pinned": 9,
        "registration_generation": 0,
        "freed_by_notification": 5,
        "freed_by_expiry": 1,
        "notifs_per_rank": [5, 5],
    }
    snap = prometheus_snapshot(generate_latest(build_registry(lambda: stats)).decode())
    assert (snap.blocks_in_use, snap.blocks_total, snap.pinned_requests) == (16, 64, 3)
    assert snap.usage == 0.25
    expected = {"pinned_block_seconds": 12.5, "refused_no_blocks": 2, "notifs_unknown": 4}
    assert snap.counters == {
        **expected,
        "requests_pinned": 9,
        "freed_by_notification": 5,
        "freed_by_expiry": 1,
    }


def test_the_sidecars_release_counters() -> None:
    metrics = Metrics()
    metrics.releases.labels("nixl", "sent").inc(3)
    metrics.releases.labels("nixl", "covered_by_engine").inc()
    metrics.rejections.labels("rejected_4xx").inc(4)
    metrics.queue_depth.set(2)
    metrics.released_blocks.labels("nixl").inc(12)
    metrics.released_blocks.labels("http").inc(4)
    metrics.block_seconds_saved.labels("nixl").inc(350.5)
    counters = sidecar_counters_from_text(generate_latest(metrics.registry).decode())
    assert counters["releases.sent"] == 3 and counters["releases.covered_by_engine"] == 1
    assert counters["released_blocks"] == 16 and counters["block_seconds_saved"] == 350.5
    assert counters["rejections.rejected_4xx"] == 4 and counters["queue_depth"] == 2
    assert deltas({"releases.sent": 1.0}, counters)["releases.sent"] == 2
    assert deltas({"queue_depth": 5.0}, counters)["queue_depth"] == 2  # a gauge is taken as it is


@pytest.mark.parametrize(
    ("snap", "idle"),
    [
        (PSnapshot(pinned_requests=0, blocks_in_use=5), True),  # the simulator's exact figure wins
        (PSnapshot(pinned_requests=2), False),
        (PSnapshot(blocks_in_use=0.0), True),
        (PSnapshot(blocks_in_use=3.0), False),
        # vLLM's /metrics: only the pool fraction; blocks still held keep the drain waiting
        (PSnapshot(usage=0.25), False),
        (PSnapshot(usage=0.0), True),
        (PSnapshot(), True),
    ],
)
def test_drain_waits_while_p_holds_blocks(snap: PSnapshot, idle: bool) -> None:
    assert _idle(snap) is idle
