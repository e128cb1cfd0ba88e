"""The example alerts and dashboard parse, and name only metrics and labels the sidecar exports.

The sidecar's metrics are read from its source (every ``Counter``, ``Gauge``,
``Histogram`` and ``Summary`` created with a ``kvr_`` name under
``sidecar/``, simulators excluded), so a renamed metric or label, or a label
value that no code path produces, fails here instead of leaving an alert that
can never fire.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, get_args

import pytest
import yaml

from sidecar.classify import Cause, Outcome
from sidecar.config import ReleaseStrategy
from sidecar.config.settings import OffReason
from sidecar.network.routable import REFUSALS as ADDRESS_REFUSALS
from sidecar.nixl import REFUSALS
from sidecar.release.base import JobResult
from tests.deploy.manifests import DOCS, ROOT

ALERTS = DOCS / "alerts.yaml"
DASHBOARD = DOCS / "grafana-dashboard.json"
# The operator's pages: the metrics reference and alerts, the strategies, and the pages they link.
METRICS_PAGE = DOCS / "metrics.md"
STRATEGIES_PAGE = DOCS / "strategies.md"
OPERATOR_PAGES = [
    DOCS / name
    for name in ("deploy.md", "metrics.md", "strategies.md", "tracing.md", "workers.md", "vllm-releases.md")
]
# Labels Prometheus adds to every scraped series of a PodMonitor target.
TARGET_LABELS = {"namespace", "pod", "container", "job", "instance", "endpoint", "service"}
# Label values the code produces from an enumeration: (metric, label) -> values.
ENUM_VALUES: dict[tuple[str, str], set[str]] = {
    ("kvr_releases", "result"): {r.value for r in JobResult},
    ("kvr_rejections", "cause"): {c.value for c in Cause},
    ("kvr_not_released", "cause"): {c.value for c in Cause},
    ("kvr_not_released", "outcome"): {o.value for o in Outcome},
    ("kvr_nixl_refused", "reason"): set(REFUSALS),
    ("kvr_prefill_refused", "reason"): {"not_allowed", *ADDRESS_REFUSALS},
    ("kvr_releases_enabled", "reason"): {"on", "setting", *(r for r in get_args(OffReason) if r)},
}
SEVERITIES = {"critical", "warning", "info"}
DURATION = re.compile(r"^[0-9]+(ms|s|m|h|d|w|y)$")
METRIC_REF = re.compile(r"\b(kvr_[a-z0-9_]+)(\{[^}]*\})?")
MATCHER = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)\s*(=~|!~|!=|=)\s*"([^"]*)"')
GROUPING = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")
SUFFIXES = {
    "Counter": ("_total", "_created"),
    "Gauge": ("",),
    "Histogram": ("_bucket", "_sum", "_count", "_created"),
    "Summary": ("", "_sum", "_count", "_created"),
}


@dataclass(frozen=True)
class Family:
    name: str  # as registered (prometheus_client strips a counter's _total)
    kind: str
    labels: frozenset[str]

    def series(self) -> set[str]:
        return {self.name + suffix for suffix in SUFFIXES[self.kind]}


def _families() -> dict[str, Family]:
    found: dict[str, Family] = {}
    for path in sorted((ROOT / "sidecar").rglob("*.py")):
        if "sim" in path.relative_to(ROOT / "sidecar").parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            family = _family(node)
            if family is not None:
                found[family.name] = family
    return found


def _family(node: ast.AST) -> Family | None:
    if not isinstance(node, ast.Call) or not node.args:
        return None
    func = node.func
    kind = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
    first = node.args[0]
    if kind not in SUFFIXES or not isinstance(first, ast.Constant) or not str(first.value).startswith("kvr_"):
        return None
    label_node = node.args[2] if len(node.args) > 2 else None
    for keyword in node.keywords:
        if keyword.arg == "labelnames":
            label_node = keyword.value
    labels = [e.value for e in getattr(label_node, "elts", []) if isinstance(e, ast.Constant)]
    name = str(first.value).removesuffix("_total") if kind == "Counter" else str(first.value)
    return Family(name, kind, frozenset(map(str, labels)))


FAMILIES = _families()
SERIES = {series: family for family in FAMILIES.values() for series in family.series()}


def test_metric_scan_finds_the_sidecar_metrics() -> None:
    """The scan itself works: the families every other check relies on are found with their labels."""
    assert FAMILIES["kvr_releases"].labels == {"strategy", "result"}
    assert FAMILIES["kvr_release_latency_seconds"].kind == "Histogram"
    assert "kvr_nixl_refused" in FAMILIES and "kvr_release_queue_depth" in FAMILIES
    assert not any(name.startswith("kvr_sim_") for name in FAMILIES)


def check_promql(expr: str) -> list[str]:
    """Problems with the kvr_* series, label matchers and groupings in one PromQL expression."""
    problems: list[str] = []
    allowed = set(TARGET_LABELS) | {"le"}
    for match in METRIC_REF.finditer(expr):
        series, matchers = match.group(1), match.group(2) or ""
        family = SERIES.get(series)
        if family is None:
            problems.append(f"{series}: no such series")
            continue
        allowed |= family.labels
        for label, op, value in MATCHER.findall(matchers):
            if label not in family.labels | TARGET_LABELS | ({"le"} if series.endswith("_bucket") else set()):
                problems.append(f"{series}: no label {label}")
            known = ENUM_VALUES.get((family.name, label))
            if known is not None and "$" not in value:
                values = value.split("|") if op in ("=~", "!~") else [value]
                problems.extend(f"{series}{{{label}}}: no value {v!r}" for v in values if v not in known)
    for group in GROUPING.findall(expr):
        for label in filter(None, (part.strip() for part in group.split(","))):
            if label not in allowed:
                problems.append(f"grouping by {label}: not a label of {expr!r}")
    return problems


@pytest.mark.parametrize(
    ("expr", "bad"),
    [
        ('sum by (cause) (rate(kvr_rejections_total{cause="rejected_4xx"}[5m]))', False),
        ("rate(kvr_rejections[5m])", True),  # the counter's series is kvr_rejections_total
        ('rate(kvr_releases_total{result="fail"}[5m])', True),  # no such result
        ('rate(kvr_releases_total{reason="sent"}[5m])', True),  # no such label
        ("sum by (reason) (rate(kvr_releases_total[5m]))", True),
        ("histogram_quantile(0.9, sum by (le) (rate(kvr_release_latency_seconds_bucket[5m])))", False),
    ],
)
def test_control_promql_checker(expr: str, bad: bool) -> None:
    assert bool(check_promql(expr)) is bad


def alert_rules() -> Iterator[dict[str, Any]]:
    document = yaml.safe_load(ALERTS.read_text())
    for group in document["groups"]:
        yield from group["rules"]


def test_alerts_have_the_rule_group_shape() -> None:
    document = yaml.safe_load(ALERTS.read_text())
    assert set(document) == {"groups"} and document["groups"]
    names = [group["name"] for group in document["groups"]]
    assert len(names) == len(set(names))
    for group in document["groups"]:
        assert set(group) <= {"name", "interval", "limit", "rules"} and group["rules"], group["name"]
        for rule in group["rules"]:
            assert set(rule) <= {"alert", "expr", "for", "keep_firing_for", "labels", "annotations"}, rule
            assert isinstance(rule["alert"], str) and isinstance(rule["expr"], str)
            assert DURATION.match(str(rule.get("for", "0m"))), rule["alert"]
            assert rule["labels"]["severity"] in SEVERITIES
            assert rule["annotations"]["summary"] and rule["annotations"]["description"]
    alerts = [rule["alert"] for rule in alert_rules()]
    assert len(alerts) == len(set(alerts))


def test_alerts_cover_failing_releases_rejections_and_the_queue() -> None:
    exprs = " ".join(rule["expr"] for rule in alert_rules())
    for needed in ('result="failed"', "kvr_rejections_total", "kvr_release_queue_depth", 'result="dropped"'):
        assert needed in exprs


@pytest.mark.parametrize("rule", list(alert_rules()), ids=lambda rule: rule["alert"])
def test_alert_expressions_name_real_metrics(rule: dict[str, Any]) -> None:
    assert METRIC_REF.search(rule["expr"])
    assert check_promql(rule["expr"]) == []


def _strings(node: Any) -> Iterator[str]:
    if isinstance(node, str):
        yield node
    elif isinstance(node, dict):
        for value in node.values():
            yield from _strings(value)
    elif isinstance(node, list):
        for value in node:
            yield from _strings(value)


def _dashboard_panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])


def test_dashboard_is_a_grafana_dashboard() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["title"] and dashboard["uid"] and isinstance(dashboard["schemaVersion"], int)
    panels = list(_dashboard_panels(dashboard))
    ids = [panel["id"] for panel in panels]
    assert len(ids) == len(set(ids))
    graphs = [panel for panel in panels if panel["type"] != "row"]
    assert graphs
    for panel in graphs:
        assert panel["title"] and set(panel["gridPos"]) == {"h", "w", "x", "y"}
        assert panel["targets"] and all(t["expr"] and t["refId"] for t in panel["targets"])
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    used = set(re.findall(r"\$\{?(\w+)", " ".join(_strings(dashboard["panels"]))))
    assert used - {"__rate_interval", "__interval"} <= variables


def test_dashboard_expressions_name_real_metrics() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    problems = [p for text in _strings(dashboard) if "kvr_" in text for p in check_promql(text)]
    assert problems == []


def test_the_docs_list_every_metric_strategy_and_alert() -> None:
    metrics = METRICS_PAGE.read_text()
    for family in FAMILIES.values():
        exposed = family.name + ("_total" if family.kind == "Counter" else "")
        assert re.search(rf"`{exposed}`", metrics), f"{exposed} missing from the metrics reference"
    for rule in alert_rules():
        assert f"`{rule['alert']}`" in metrics
    strategies = STRATEGIES_PAGE.read_text()
    for strategy in get_args(ReleaseStrategy):
        assert f"| `{strategy}`" in strategies, f"release strategy {strategy} not described"


def test_paths_named_in_the_docs_exist() -> None:
    text = "\n".join(page.read_text() for page in OPERATOR_PAGES)
    paths = set(re.findall(r"`((?:deploy|docs|sidecar|tests)/[\w./-]+)`", text))
    assert paths
    for path in paths:
        assert (ROOT / path.rstrip("/")).exists(), path
    for path in re.findall(
        r"`((?:base|sidecar|router|loadtest|example-prefill)/[\w.-]+\.(?:yaml|toml))`", text
    ):
        assert (ROOT / "deploy" / path).exists(), path
