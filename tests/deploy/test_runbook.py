"""docs/runbook.md covers every alert and every failure reason, and its off switch is a valid config.

The alerts are read from docs/alerts.yaml and the reasons from
``sidecar.exceptions.Reason``, so a new one fails here until the runbook says
what to do about it. The off switch is taken from the page as written: its
TOML block and its container ``env`` block are loaded with the sidecar's own
loaders (``serve``'s and ``pd-sidecar``'s), and its llm-d instruction (the
``release-off`` component in place of ``dry-run`` in docs/llm-d-swap.md's
kustomization) is rendered with kustomize against llm-d's manifests.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from sidecar.config import load as load_serve
from sidecar.exceptions import Reason
from sidecar.llmd.command import load as load_llmd
from tests.deploy.manifests import (
    DOCS,
    DRY_RUN_COMPONENT,
    ROOT,
    SHAPES,
    decode_pod,
    lay_out,
    swap_kustomization,
)

PAGE = DOCS / "runbook.md"
GUIDE_ARGS = ["--port=8000", "--kv-connector=nixlv2", "--zap-log-level=1", "--secure-serving=false"]


def blocks(lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", PAGE.read_text(), re.S | re.M)


def section(title: str) -> str:
    text = PAGE.read_text()
    start = text.index(f"## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else None]


def first_column(table: str) -> set[str]:
    return set(re.findall(r"^\| `([a-z_A-Z]+)` \|", table, re.M))


def test_every_alert_has_a_row() -> None:
    groups = yaml.safe_load((DOCS / "alerts.yaml").read_text())["groups"]
    alerts = {rule["alert"] for group in groups for rule in group["rules"] if "alert" in rule}
    assert alerts
    assert first_column(section("Alerts")) == alerts


def test_every_failure_reason_has_a_row() -> None:
    assert first_column(section("Failure reasons")) == {reason.value for reason in Reason}
    assert "unknown_wire" in {reason.value for reason in Reason}


def test_the_toml_off_switch_loads_as_release_off() -> None:
    [toml] = blocks("toml")
    config = load_serve({}, {}, toml)
    assert config.release == "off"


def test_the_env_off_switch_loads_as_release_off_for_serve_and_pd_sidecar() -> None:
    [block] = blocks("yaml")
    env = {e["name"]: e["value"] for e in yaml.safe_load(block)["env"]}
    assert env == {"KVR_RELEASE": "off"}
    assert load_serve({}, env, None).release == "off"
    config, _ = load_llmd(GUIDE_ARGS, env)
    assert config.release == "off"


@pytest.mark.parametrize("shape", SHAPES)
def test_the_llm_d_off_switch_renders_release_off_on_the_routing_sidecar(tmp_path: Path, shape: str) -> None:
    assert "deploy/llm-d/release-off" in section("The off switch, and what it costs")
    kustomization = swap_kustomization().replace(DRY_RUN_COMPONENT, "deploy/llm-d/release-off")
    _, container = decode_pod(lay_out(tmp_path, shape, kustomization).run(["kubectl", "kustomize", "swap"]))
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env == {"KVR_RELEASE": "off"}
    config, _ = load_llmd(container["args"], env)
    assert (config.release, config.dry_run) == ("off", False)


def defined_metrics() -> set[str]:
    """Every ``kvr_*`` family the sidecar's code defines, counters with their ``_total`` too."""
    names = set()
    for path in (ROOT / "sidecar").rglob("*.py"):
        names.update(re.findall(r'"(kvr_[a-z_]+)"', path.read_text()))
    return names | {name + "_total" for name in names}


@pytest.mark.parametrize("page", ["runbook.md", "llm-d-swap.md"])
def test_every_metric_the_page_names_is_defined(page: str) -> None:
    named = set(re.findall(r"\bkvr_[a-z_]+[a-z]", (DOCS / page).read_text()))
    assert named and named <= defined_metrics(), named - defined_metrics()
