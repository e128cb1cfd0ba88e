"""The request path's metric labels: status classes, and children resolved once per label set."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from sidecar.observability.metrics import Metrics, status_class


@pytest.mark.parametrize(
    ("status", "label"),
    [
        *[(100, "1xx"), (200, "2xx"), (204, "2xx"), (409, "4xx"), (503, "5xx"), (599, "5xx")],
        *[(99, "error"), (600, "error"), (0, "error"), (-1, "error"), (1000, "error")],
    ],
)
def test_a_status_falls_in_its_class(status: int, label: str) -> None:
    assert status_class(status) == label


def test_children_are_resolved_once_and_count_under_their_labels() -> None:
    metrics = Metrics(CollectorRegistry())
    first = metrics.not_released_for("no_release", "admitted")
    assert metrics.not_released_for("no_release", "admitted") is first
    first.inc()
    metrics.rejections_for("unreachable").inc(2)
    sample = metrics.registry.get_sample_value
    assert sample("kvr_not_released_total", {"outcome": "no_release", "cause": "admitted"}) == 1
    assert sample("kvr_rejections_total", {"cause": "unreachable"}) == 2


def test_requests_in_flight_are_read_when_scraped() -> None:
    metrics = Metrics(CollectorRegistry())
    metrics.requests_in_flight += 3
    assert metrics.registry.get_sample_value("kvr_inflight_requests") == 3
    metrics.requests_in_flight -= 3
    assert metrics.registry.get_sample_value("kvr_inflight_requests") == 0
