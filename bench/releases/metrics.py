"""The release workloads' readings of the sidecar's ``/metrics`` and P's ``/stats``, between two scrapes.

``Scrape`` reads both over HTTP; ``quantile`` estimates a percentile from a
Prometheus histogram between two scrapes, as ``histogram_quantile`` does;
``released``, ``release_jobs`` and ``release_latency_ms`` read the sidecar's
NIXL release counter and latency histogram.
"""

from __future__ import annotations

import math
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from bench.harness.procs import BenchError
from bench.harness.stats import ms

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


class Scrape:
    """HTTP readings of the sidecar's admin ``/metrics`` and P's ``/stats``."""

    def __init__(self, session: aiohttp.ClientSession, admin_url: str, prefill_url: str) -> None:
        self._session = session
        self._metrics_url = admin_url + "/metrics"
        self._stats_url = prefill_url + "/stats"

    async def metrics(self) -> Samples:
        async with self._session.get(self._metrics_url) as response:
            text = await response.text()
        if response.status != 200:
            raise BenchError(f"sidecar /metrics answered {response.status}")
        samples: Samples = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                samples[sample.name, frozenset(sample.labels.items())] = sample.value
        return samples

    async def prefill_stats(self) -> dict[str, Any]:
        async with self._session.get(self._stats_url) as response:
            stats: dict[str, Any] = await response.json()
        if response.status != 200:
            raise BenchError(f"P /stats answered {response.status}")
        return stats


def sample(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def delta(before: Samples, after: Samples, name: str, **labels: str) -> float:
    return sample(after, name, **labels) - sample(before, name, **labels)


def quantile(before: Samples, after: Samples, name: str, q: float, **labels: str) -> float:
    """The ``q`` (0-1) quantile of a histogram's observations between two scrapes, in its unit.

    Linear inside the bucket holding the rank, as Prometheus' ``histogram_quantile``;
    a rank in the ``+Inf`` bucket gives the largest finite bound. NaN with no observations.
    """
    bounds: list[tuple[float, float]] = []
    for (sample_name, label_set), value in after.items():
        found = dict(label_set)
        le = found.pop("le", None)
        if sample_name == name + "_bucket" and le is not None and found == labels:
            count = value - before.get((sample_name, label_set), 0.0)
            bounds.append((float(le), count))
    bounds.sort()
    if not bounds or bounds[-1][1] <= 0:
        return math.nan
    rank = q * bounds[-1][1]
    low, below = 0.0, 0.0
    for bound, cumulative in bounds:
        if cumulative >= rank:
            if math.isinf(bound):
                return low
            share = (rank - below) / (cumulative - below) if cumulative > below else 1.0
            return low + (bound - low) * share
        low, below = bound, cumulative
    return low


# The sidecar's release counter and latency histogram, and every result the counter has.
RELEASES = "kvr_releases_total"
LATENCY = "kvr_release_latency_seconds"
RESULTS = ("sent", "dropped", "failed", "refused", "duplicate", "covered_by_engine", "dry_run", "off")


def released(before: Samples, after: Samples, result: str) -> int:
    """NIXL release jobs with ``result`` the sidecar finished between two scrapes."""
    return int(delta(before, after, RELEASES, strategy="nixl", result=result))


def release_jobs(before: Samples, after: Samples) -> int:
    """NIXL release jobs the sidecar finished between two scrapes, whatever their result."""
    return sum(released(before, after, result) for result in RESULTS)


def release_latency_ms(before: Samples, after: Samples, q: float) -> float:
    """The ``q`` (0-1) quantile of the sidecar's NIXL release latency between two scrapes, in ms."""
    return ms(quantile(before, after, LATENCY, q, strategy="nixl"))
