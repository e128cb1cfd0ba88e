"""docs/llm-d-swap.md's commands do what the page says, on llm-d's own manifests.

The page's kustomization (its ``yaml`` block of ``kind: Kustomization``) and
its ``kubectl kustomize`` commands are read from the page and run, with the
kustomize users run (``tests.deploy.render``), in the layout the page asks for:
``guide/`` (llm-d's guide as its users render it: the vendored fixtures in
tests/deploy/fixtures/llm-d), ``kv-release-sidecar/`` (this checkout) and
``swap/``. The rendered decode pod must run the page's image with the dry-run
variable, load as a dry run of the ``nixl`` strategy with the sidecar's own
loader, and be selected by the PodMonitor on a port its sidecar container
declares, scraped on the admin port the sidecar listens on; the guide alone
(the rollback) must name llm-d's image again.
"""

from __future__ import annotations

import ipaddress
import itertools
import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml

from sidecar.classify import FAILURE_STATUS, NoAnswer
from sidecar.llmd.command import load
from sidecar.network.routable import refusal
from sidecar.observability.metrics import Metrics
from tests.deploy.manifests import (
    DRY_RUN_COMPONENT,
    FIXTURES,
    PAGE,
    ROOT,
    SHAPES,
    Layout,
    blocks,
    decode_pod,
    lay_out,
    pod_templates,
    selects,
    swap_kustomization,
)
from tests.deploy.render import RenderError, build, command

UPSTREAM_IMAGE = "ghcr.io/llm-d/llm-d-router-disagg-sidecar:v0.10.0"


def kustomize_commands() -> list[list[str]]:
    """Every ``kubectl kustomize DIR`` of the page's shell blocks, without what follows a pipe."""
    found = []
    for block in blocks("sh"):
        for line in block.splitlines():
            lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
            lexer.whitespace_split = True
            words = list(itertools.takewhile(lambda word: word not in ("|", ">", "&"), lexer))
            if words[:2] == ["kubectl", "kustomize"]:
                found.append(words)
    return found


def page_image() -> str:
    [entry] = yaml.safe_load(swap_kustomization())["images"]
    return f"{entry['newName']}:{entry['newTag']}"


def relabel(address: str, rule: dict[str, Any]) -> str:
    """Prometheus's ``replace`` on ``__address__`` (its regexes are anchored at both ends)."""
    match = re.fullmatch(rule["regex"], address)
    assert match, (rule["regex"], address)
    return re.sub(r"\$\{(\d+)\}", lambda m: match[int(m[1])], rule["replacement"])


def test_the_page_renders_with_the_kustomize_it_names() -> None:
    assert command()[-1] in ("kustomize", "build")
    assert [words[2] for words in kustomize_commands()] == ["swap", "guide"]


@pytest.mark.parametrize("shape", SHAPES)
def test_stage_one_runs_the_pages_image_as_a_dry_run(tmp_path: Path, shape: str) -> None:
    layout = lay_out(tmp_path, shape, swap_kustomization())
    labels, container = decode_pod(layout.run(["kubectl", "kustomize", "swap"]))
    assert container["image"] == page_image()
    env = {e["name"]: e["value"] for e in container.get("env", [])}
    assert env == {"KVR_DRY_RUN": "true"}
    config, _ = load(container["args"], env)
    assert (config.release, config.dry_run) == ("nixl", True)
    assert labels["llm-d.ai/role"] == "decode"


@pytest.mark.parametrize("shape", SHAPES)
def test_the_podmonitor_scrapes_the_admin_port_of_every_decode_pod_and_no_prefill_pod(
    tmp_path: Path, shape: str
) -> None:
    resources = lay_out(tmp_path, shape, swap_kustomization()).run(["kubectl", "kustomize", "swap"])
    [monitor] = [r for r in resources if r["kind"] == "PodMonitor"]
    labels, container = decode_pod(resources)
    assert selects(monitor["spec"]["selector"], labels)
    prefill = [
        t["metadata"]["labels"]
        for r in resources
        for t in pod_templates(r)
        if t.get("metadata", {}).get("labels", {}).get("llm-d.ai/role") == "prefill"
    ]
    assert not any(selects(monitor["spec"]["selector"], other) for other in prefill)
    [endpoint] = monitor["spec"]["podMetricsEndpoints"]
    declared = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert endpoint["port"] in declared  # Prometheus makes a target of each declared port
    [rule] = endpoint["relabelings"]
    assert rule["targetLabel"] == "__address__"
    config, _ = load(container["args"], {})
    port = declared[endpoint["port"]]
    assert relabel(f"10.4.0.7:{port}", rule) == f"10.4.0.7:{config.admin_port}"
    assert relabel(f"[fd00:10::7]:{port}", rule) == f"[fd00:10::7]:{config.admin_port}"


@pytest.mark.parametrize("shape", SHAPES)
def test_stage_two_without_the_dry_run_line_releases(tmp_path: Path, shape: str) -> None:
    live = "".join(
        line for line in swap_kustomization().splitlines(keepends=True) if DRY_RUN_COMPONENT not in line
    )
    assert live != swap_kustomization()
    _, container = decode_pod(lay_out(tmp_path, shape, live).run(["kubectl", "kustomize", "swap"]))
    assert container["image"] == page_image()
    assert "env" not in container
    config, _ = load(container["args"], {})
    assert (config.release, config.dry_run) == ("nixl", False)


@pytest.mark.parametrize("shape", SHAPES)
def test_the_rollback_renders_llm_ds_image_again(tmp_path: Path, shape: str) -> None:
    layout = lay_out(tmp_path, shape, swap_kustomization())
    [rollback] = [words for words in kustomize_commands() if words[2] == "guide"]
    _, container = decode_pod(layout.run(rollback))
    assert container["image"] == UPSTREAM_IMAGE
    assert "env" not in container


def test_the_dry_run_patch_refuses_a_layout_it_was_not_written_for(tmp_path: Path) -> None:
    guide = tmp_path / "reordered"
    guide.mkdir()
    source = FIXTURES / "disaggregatedset" / "disaggregatedset.yaml"
    resource = yaml.safe_load(source.read_text())
    resource["spec"]["roles"].reverse()  # decode first: roles[1] is the prefill role
    (guide / "disaggregatedset.yaml").write_text(yaml.safe_dump(resource))
    (guide / "kustomization.yaml").write_text("resources:\n  - disaggregatedset.yaml\n")
    kustomization = swap_kustomization().replace("../guide", "../reordered")
    layout = lay_out(tmp_path, "disaggregatedset", kustomization)
    with pytest.raises(RenderError, match="testing value"):
        layout.run(["kubectl", "kustomize", "swap"])


def test_every_metric_the_pages_promql_names_exists() -> None:
    exported = {
        name for family in Metrics().registry.collect() for name in (family.name, family.name + "_total")
    }
    named = set(re.findall(r"\bkvr_[a-z_]+", "".join(blocks("promql"))))
    assert named and named <= exported, named - exported


def test_the_answers_the_page_says_differ_are_the_codes() -> None:
    text = PAGE.read_text()
    assert FAILURE_STATUS[NoAnswer.CONNECT_REFUSED] == 503
    assert {FAILURE_STATUS[f] for f in (NoAnswer.DNS, NoAnswer.CONNECT_TIMEOUT, NoAnswer.TLS_FAILED)} == {503}
    assert FAILURE_STATUS[NoAnswer.POOL_TIMEOUT] == 503
    assert FAILURE_STATUS[NoAnswer.HEADER_TIMEOUT] == 504
    assert FAILURE_STATUS[NoAnswer.RESET_AFTER_SEND] == 502
    assert FAILURE_STATUS[NoAnswer.PREFILL_ANSWER_TOO_LARGE] == 502
    for address in ("127.0.0.1", "169.254.169.254", "0.0.0.0", "224.0.0.1"):
        assert refusal(ipaddress.ip_address(address)) is not None, address
    for claim in ("| 400 (`param: n`)", "| 403,", "| 503 when nothing was sent", "504 when D sent"):
        assert claim in text, claim


def metrics_port_patch() -> str:
    [text] = [b for b in blocks("yaml") if "kind: PodMonitor" in b and "patches:" in b]
    return text


@pytest.mark.parametrize("shape", SHAPES)
def test_with_metrics_port_the_pages_patch_moves_the_scrape_to_the_admin_port(
    tmp_path: Path, shape: str
) -> None:
    """llm-d's ``--metrics-port`` moves the admin port; the PodMonitor follows it only with the
    page's patch (without it, Prometheus would scrape 9100, where nothing listens)."""
    port = int(re.search(r":(\d+)", metrics_port_patch().split("value:")[1])[1])
    guide = tmp_path / "guide"
    guide.mkdir()
    rendered = build(FIXTURES / shape)
    _, container = decode_pod(rendered)
    container["args"].append(f"--metrics-port={port}")
    (guide / "all.yaml").write_text(yaml.safe_dump_all(rendered))
    (guide / "kustomization.yaml").write_text("resources:\n  - all.yaml\n")
    (tmp_path / "kv-release-sidecar").symlink_to(ROOT)
    (tmp_path / "swap").mkdir()
    layout = Layout(tmp_path)
    scraped = {}
    for name, text in (
        ("without", swap_kustomization()),
        ("with", swap_kustomization() + metrics_port_patch()),
    ):
        (tmp_path / "swap" / "kustomization.yaml").write_text(text)
        resources = layout.run(["kubectl", "kustomize", "swap"])
        [monitor] = [r for r in resources if r["kind"] == "PodMonitor"]
        _, sidecar = decode_pod(resources)
        config, _ = load(sidecar["args"], {})
        [rule] = monitor["spec"]["podMetricsEndpoints"][0]["relabelings"]
        scraped[name] = relabel("10.4.0.7:8000", rule)
    assert config.admin_port == port != 9100
    assert scraped == {"without": "10.4.0.7:9100", "with": f"10.4.0.7:{port}"}


def test_the_rollback_is_the_guide_not_a_rollout_undo() -> None:
    """``kubectl rollout undo`` goes back one revision (stage one's dry run, or releases on again
    after the runbook's off switch): the page runs no such command and says why not."""
    assert not any("rollout undo" in block for block in blocks("sh"))
    text = " ".join(PAGE.read_text().split())
    rollback = text[text.index("## 6. Roll back") : text.index("## 7.")]
    assert "Not `kubectl rollout undo`" in rollback and "dry run" in rollback and "release-off" in rollback
