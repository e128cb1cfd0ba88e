"""Prometheus view of the simulated P, on a registry of its own.

A custom collector reads the ``/stats`` snapshot at scrape time, so the
numbers on ``/metrics`` and ``/stats`` cannot drift apart. Names start with
``kvr_sim_prefill_``; labels are small enumerations (cause, kind, rank). Two
series also carry vLLM's own names and labels (``model_name``, ``engine``),
the ones a P is checked by on real vLLM: ``vllm:kv_cache_usage_perc`` (the
share of the pool pinned) and ``vllm:nixl_num_kv_expired_reqs_total``
(requests freed by the lease), so a page's check of P runs the same on the
simulator.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

PREFIX = "kvr_sim_prefill_"
_GAUGES = {
    "blocks_total": "KV blocks in P's pool",
    "blocks_in_use": "KV blocks held by pinned requests",
    "pinned_requests": "requests whose blocks wait for D",
    "registration_generation": "handshake metadata generation (bumped on agent restart)",
}
_COUNTERS = {
    "pinned_block_seconds": "integral of blocks in use over time",
    "refused_no_blocks": "requests refused with 503 for lack of blocks",
    "handshakes_served": "side-channel handshakes answered",
    "notifs_unknown": "notifications for ids P does not hold",
    "notifs_malformed": "notifications that raise in a real P worker",
    "notifs_heartbeat": "heartbeat notifications (0.22.0+)",
    "worker_errors": "events that raise in a real P worker or engine",
    "requests_pinned": "requests whose blocks were pinned for D",
}


class _StatsCollector(Collector):
    def __init__(self, stats: Callable[[], Mapping[str, Any]], model: str) -> None:
        self._stats = stats
        self._model = model

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        for name, doc in _GAUGES.items():
            yield GaugeMetricFamily(PREFIX + name, doc, value=float(stats[name]))
        alive = GaugeMetricFamily(PREFIX + "listener_alive", "1 while the side channel answers")
        alive.add_metric([], 1.0 if stats["listener_alive"] else 0.0)
        yield alive
        for name, doc in _COUNTERS.items():
            yield CounterMetricFamily(PREFIX + name, doc, value=float(stats[name]))
        freed = CounterMetricFamily(PREFIX + "freed", "requests freed", labels=["cause"])
        freed.add_metric(["notification"], float(stats["freed_by_notification"]))
        freed.add_metric(["expiry"], float(stats["freed_by_expiry"]))
        yield freed
        per_rank = CounterMetricFamily(PREFIX + "notifications", "notifications received", labels=["rank"])
        for rank, count in enumerate(stats["notifs_per_rank"]):
            per_rank.add_metric([str(rank)], float(count))
        yield per_rank
        yield from self._vllm(stats)

    def _vllm(self, stats: Mapping[str, Any]) -> Iterator[Metric]:
        """vLLM's names for the two series P is judged by (``vllm/v1/metrics/loggers.py``,
        ``kv_connector/v1/nixl/stats.py``): one engine, index 0."""
        labels, values = ["model_name", "engine"], [self._model, "0"]
        usage = GaugeMetricFamily(
            "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", labels=labels
        )
        usage.add_metric(values, float(stats["blocks_in_use"]) / max(1, int(stats["blocks_total"])))
        yield usage
        expired = CounterMetricFamily(
            "vllm:nixl_num_kv_expired_reqs",
            "Number of requests that had their KV expire. NOTE: This metric is tracked on the P instance.",
            labels=labels,
        )
        expired.add_metric(values, float(stats["freed_by_expiry"]))
        yield expired


def build_registry(stats: Callable[[], Mapping[str, Any]], model: str = "sim-model") -> CollectorRegistry:
    """A fresh registry exposing ``stats()`` (one per app, never the global one)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_StatsCollector(stats, model))
    return registry
