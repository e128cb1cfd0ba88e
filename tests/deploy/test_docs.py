"""The example alerts and dashboard parse, and name only metrics and labels the sidecar exports;
the metrics reference (docs/metrics.md) says what the code exports.

The sidecar's metrics are read from its source (every ``Counter``, ``Gauge``,
``Histogram`` and ``Summary`` created with a ``kvr_`` name under
``sidecar/``, simulators excluded), so a renamed metric or label, or a label
value that no code path produces, fails here instead of leaving an alert that
can never fire. The reference's tables are read row by row: each row's name,
type and labels are a family's, every family has a row, every label value a
row lists is one the code produces, and where the code enumerates a label's
values (``EXACT``) the row lists every one of them; its alert table lists the
alerts of docs/alerts.yaml.
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

import sidecar.nixl
from sidecar.classify import Cause, NoAnswer, Outcome
from sidecar.config import ReleaseStrategy
from sidecar.config.settings import OffReason
from sidecar.decision.judge import LEASE_EXPIRED, RETRYABLE
from sidecar.exceptions import Reason, RetryableReleaseError
from sidecar.network import resolver
from sidecar.network.routable import REFUSALS as ADDRESS_REFUSALS
from sidecar.nixl import REFUSALS, RETRIES
from sidecar.observability.metrics import ROUTES
from sidecar.params import Ineligible
from sidecar.release.base import JobResult
from sidecar.release.pipeline import BreakerState
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
    ("kvr_requests", "route"): set(ROUTES.values()),
    ("kvr_releases", "result"): {r.value for r in JobResult},
    ("kvr_rejections", "cause"): {c.value for c in Cause},
    ("kvr_not_released", "cause"): {c.value for c in Cause} | {LEASE_EXPIRED, "params_in_use"},
    ("kvr_not_released", "outcome"): {Outcome.NO_RELEASE.value, Outcome.AMBIGUOUS.value, RETRYABLE},
    ("kvr_ineligible", "reason"): {r.value for r in Ineligible},
    ("kvr_released_replays", "action"): {"refused", "forwarded"},
    ("kvr_release_attempts", "reason"): {"ok", *(r.value for r in Reason)},
    ("kvr_release_targets", "state"): {s.value for s in BreakerState},
    ("kvr_leg_failures", "cause"): {"status_4xx", "status_5xx", "decode_only_fallback", *NoAnswer},
    ("kvr_nixl_releases", "outcome"): {"refused", "error", *(r.value for r in JobResult)},
    ("kvr_nixl_refused", "reason"): set(REFUSALS),
    ("kvr_nixl_errors", "reason"): set(RETRIES),
    ("kvr_prefill_refused", "reason"): {"not_allowed", *ADDRESS_REFUSALS},
    ("kvr_releases_enabled", "reason"): {"on", "setting", *(r for r in get_args(OffReason) if r)},
}
#: The labels whose every value the code enumerates: the reference must list each one.
EXACT = {
    ("kvr_requests", "route"),
    ("kvr_releases", "result"),
    ("kvr_ineligible", "reason"),
    ("kvr_released_replays", "action"),
    ("kvr_release_targets", "state"),
    ("kvr_nixl_refused", "reason"),
    ("kvr_nixl_errors", "reason"),
    ("kvr_prefill_refused", "reason"),
    ("kvr_releases_enabled", "reason"),
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


@dataclass(frozen=True)
class Row:
    """One row of a metrics table in docs/metrics.md: its labels and the values it lists for each,
    and whether it lists them all (no ``...``, no prose where a value would be)."""

    name: str
    kind: str
    labels: dict[str, tuple[set[str], bool]]


KINDS = {"counter": "Counter", "gauge": "Gauge", "histogram": "Histogram", "summary": "Summary"}


def label_cell(cell: str) -> dict[str, tuple[set[str], bool]]:
    """``cell``'s labels: each a backticked name, optionally followed by its values in parentheses.

    The values are the backticked words directly inside those parentheses (deeper parentheses
    comment on one value); the list is complete unless a comma-separated part of it names no
    value (``...``, a phrase such as "the failure reason").
    """
    labels: dict[str, tuple[set[str], bool]] = {}
    depth, current, part, parts = 0, "", "", []
    for at, char in enumerate(cell):
        if char == "(":
            depth += 1
            if depth == 1:
                part, parts = "", []
                continue
        elif char == ")":
            depth -= 1
            if depth == 0:
                parts.append(part)
                values = {v for p in parts for v in re.findall(r"`([^`]+)`", _depth_one(p))}
                complete = all(re.search(r"`[^`]+`", _depth_one(p)) for p in parts)
                labels[current] = (values, complete)
                continue
        if depth == 0:
            name = re.match(r"`([a-z_]+)`", cell[at:])
            if name and (at == 0 or cell[at - 1] != "`"):
                current = name.group(1)
                labels.setdefault(current, (set(), False))
        elif depth >= 1:
            if depth == 1 and char == ",":
                parts.append(part)
                part = ""
            else:
                part += char if depth == 1 else ("(" if char == "(" else ")" if char == ")" else "\0")
    return labels


def _depth_one(part: str) -> str:
    """``part`` without what nested parentheses hold (``label_cell`` blanks it as NUL)."""
    return re.sub(r"\((\0|[()])*\)", "", part)


def metric_rows() -> dict[str, Row]:
    rows: dict[str, Row] = {}
    for line in METRICS_PAGE.read_text().splitlines():
        if not line.startswith("| `kvr_"):
            continue
        first, kind, cell, *_ = (c.strip() for c in line.strip().strip("|").split("|"))
        name = first.strip("`")
        assert name not in rows, f"{name}: two rows in docs/metrics.md"
        rows[name] = Row(name, kind, label_cell(cell))
    return rows


def test_the_label_cell_reader() -> None:
    """The reader itself: values, commentary in deeper parentheses, and what makes a list partial."""
    cell = "`leg` (`prefill`), `cause` (`a` (note: `x`, `y`), `b`, ...), `path`"
    assert label_cell(cell) == {
        "leg": ({"prefill"}, True),
        "cause": ({"a", "b"}, False),
        "path": (set(), False),
    }
    assert label_cell("`reason` (`ok`, the failure reason, or `target_down`)") == {
        "reason": ({"ok", "target_down"}, False)
    }
    assert label_cell("") == {}


def test_the_metrics_reference_is_the_code() -> None:
    """Every family has one row with its type and labels; every row is a family."""
    rows, problems = metric_rows(), []
    exposed = {f.name + ("_total" if f.kind == "Counter" else ""): f for f in FAMILIES.values()}
    problems += [f"{name}: no row in docs/metrics.md" for name in sorted(set(exposed) - set(rows))]
    problems += [
        f"{name}: a row, but the code exports no such metric" for name in sorted(set(rows) - set(exposed))
    ]
    for name in sorted(set(rows) & set(exposed)):
        row, family = rows[name], exposed[name]
        if KINDS.get(row.kind) != family.kind:
            problems.append(f"{name}: a {row.kind} in the docs, a {family.kind} in the code")
        if set(row.labels) != family.labels:
            problems.append(
                f"{name}: labels {sorted(row.labels)} in the docs, {sorted(family.labels)} in the code"
            )
    assert problems == []


def test_every_label_value_in_the_reference_is_the_codes() -> None:
    """Listed values exist in the code; where the code enumerates them all, the row lists them all."""
    problems = []
    exact_seen = set()
    for row in metric_rows().values():
        family = row.name.removesuffix("_total") if row.kind == "counter" else row.name
        for label, (values, complete) in row.labels.items():
            known = ENUM_VALUES.get((family, label))
            if known is None:
                continue
            problems += [
                f"{row.name}{{{label}}}: {v!r} is no value of the code" for v in sorted(values - known)
            ]
            if (family, label) in EXACT:
                exact_seen.add((family, label))
                missing = sorted(known - values)
                if missing or not complete:
                    problems.append(
                        f"{row.name}{{{label}}}: the row must list every value: missing {missing}"
                    )
    assert problems == []
    assert exact_seen == EXACT


def test_the_nixl_reasons_are_its_errors() -> None:
    """``sidecar.nixl``'s lists are what its errors raise: every retryable error class of the NIXL
    path has its reason in ``RETRIES``, and no reason is listed twice."""
    classes = [
        obj
        for module in (sidecar.nixl, resolver)
        for obj in vars(module).values()
        if isinstance(obj, type)
        and issubclass(obj, RetryableReleaseError)
        and obj.__module__ == module.__name__
    ]
    assert {cls.reason for cls in classes} == set(RETRIES)
    assert len(set(RETRIES)) == len(RETRIES) and len(set(REFUSALS)) == len(REFUSALS)
    assert not set(RETRIES) & set(REFUSALS)


def test_the_alert_table_is_the_rule_file() -> None:
    text = METRICS_PAGE.read_text()
    table = text[text.index("| alert | fires when |") :]
    listed = re.findall(r"^\| `(KV\w+)` \|", table, re.M)
    assert sorted(listed) == sorted(rule["alert"] for rule in alert_rules())


def test_a_share_of_p_d_requests_divides_by_p_d_requests() -> None:
    """An alert whose summary speaks of P/D requests divides by them (every releasable P/D request is
    counted once, in ``kvr_rejections_total`` or ``kvr_not_released_total``), not by every
    inspected request (``kvr_requests_total``)."""
    rules = [rule for rule in alert_rules() if "P/D requests" in rule["annotations"]["summary"]]
    assert rules
    for rule in rules:
        denominator = rule["expr"].split("/", 1)[1]
        assert "kvr_requests_total" not in denominator, rule["alert"]
        assert "kvr_rejections_total" in denominator and "kvr_not_released_total" in denominator, rule[
            "alert"
        ]
