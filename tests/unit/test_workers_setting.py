"""``workers``: how many processes ``auto`` means, and how the admin port merges their metrics."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from sidecar.app.fleet import Totals
from sidecar.server.workers import count

CPUS = len(os.sched_getaffinity(0))


def _cgroup(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    return tmp_path


def test_a_number_is_taken_as_it_is(tmp_path: Path) -> None:
    assert count("3", tmp_path) == 3


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        ({"cpu.max": "150000 100000\n"}, 2),  # 1.5 cores: two processes, the second part-time
        ({"cpu.max": "100000 100000\n"}, 1),
        ({"cpu.max": "50000 100000\n"}, 1),
        ({"cpu/cpu.cfs_quota_us": "200000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 2),  # cgroup v1
    ],
)
def test_auto_follows_the_cpu_quota_not_the_hosts_cores(
    tmp_path: Path, files: dict[str, str], expected: int
) -> None:
    assert count("auto", _cgroup(tmp_path, files)) == min(expected, CPUS)


@pytest.mark.parametrize(
    "files",
    [{"cpu.max": "max 100000\n"}, {"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, {}],
)
def test_auto_without_a_quota_is_the_cpus_this_process_may_run_on(
    tmp_path: Path, files: dict[str, str]
) -> None:
    assert count("auto", _cgroup(tmp_path, files)) == min(CPUS, 32)


def _worker(requests: int, ready: int, ledger: int, latencies: list[float]) -> str:
    registry = CollectorRegistry()
    Counter("kvr_requests", "Requests.", ["route"], registry=registry).labels("/v1/completions").inc(requests)
    Gauge("kvr_ready", "Ready.", registry=registry).set(ready)
    Gauge("kvr_release_ledger_size", "Ledger.", registry=registry).set(ledger)
    Gauge("kvr_inflight_requests", "In flight.", registry=registry).set(requests % 3)
    histogram = Histogram("kvr_upstream_latency_seconds", "Latency.", registry=registry, buckets=(0.1, 1.0))
    for value in latencies:
        histogram.observe(value)
    return generate_latest(registry).decode()


def _samples(text: bytes) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text.decode())
        for s in family.samples
        if not s.name.endswith("_created")
    }


def test_metrics_merge_sums_work_and_takes_shared_gauges_once() -> None:
    merged = _samples(Totals().merge({0: _worker(4, 1, 7, [0.05, 2.0]), 1: _worker(5, 0, 7, [0.5])}))
    assert merged[("kvr_requests_total", (("route", "/v1/completions"),))] == 9
    assert merged[("kvr_inflight_requests", ())] == 1 + 2
    assert merged[("kvr_ready", ())] == 0  # ready only when every worker is
    assert merged[("kvr_release_ledger_size", ())] == 7  # one shared ledger, seen by both
    assert merged[("kvr_upstream_latency_seconds_bucket", (("le", "0.1"),))] == 1
    assert merged[("kvr_upstream_latency_seconds_bucket", (("le", "1.0"),))] == 2
    assert merged[("kvr_upstream_latency_seconds_count", ())] == 3
    assert merged[("kvr_upstream_latency_seconds_sum", ())] == pytest.approx(2.55)


def test_one_worker_merged_is_its_own_metrics() -> None:
    text = _worker(4, 1, 7, [0.05])
    assert _samples(Totals().merge({0: text})) == _samples(text.encode())


def test_a_dead_workers_counts_stay_in_the_totals() -> None:
    totals = Totals()
    totals.merge({0: _worker(4, 1, 0, [0.05]), 1: _worker(5, 1, 0, [0.5])})
    totals.retire(1)  # worker 1 died; its replacement starts from zero
    merged = _samples(totals.merge({0: _worker(6, 1, 0, [0.05, 0.05]), 1: _worker(1, 1, 0, [])}))
    assert merged[("kvr_requests_total", (("route", "/v1/completions"),))] == 6 + 5 + 1
    assert merged[("kvr_upstream_latency_seconds_count", ())] == 2 + 1
    assert merged[("kvr_inflight_requests", ())] == 0 + 1  # gauges: only the living
