"""The guides an operator follows agree with each other and with what the repository builds.

deploy/README.md and docs/deploy.md give the same ordered checklist; the
plugin's install instructions are the plugin Dockerfile itself; no guide
installs this project from a package index that does not serve it.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.deploy.manifests import (
    DEPLOY,
    DOCS,
    PLUGIN_DOCKERFILE,
    ROOT,
    Pod,
    config_file_path,
    config_file_text,
    dockerfile_instructions,
    find,
    rendered,
)

DEPLOY_README = DEPLOY / "README.md"
DEPLOY_GUIDE = DOCS / "deploy.md"
GUIDES = [ROOT / "README.md", DEPLOY_README, *sorted(DOCS.glob("*.md"))]
STEP = re.compile(r"^(\d+)\. \*\*(.+?)\*\*", re.MULTILINE)
CHECK_MARKER = "<!-- CHECK-COMMAND:"
CHECK_COMMAND = re.compile(
    r"kubectl -n (\S+) exec deploy/(\S+) -c (\S+) -- kv-release-sidecar check --config ([\w./-]+)"
)


def checklist(path: Path) -> list[str]:
    """The titles of the numbered steps under the checklist heading, in order."""
    text = path.read_text()
    start = re.search(r"^#+ .*[Cc]hecklist.*$", text, re.MULTILINE)
    assert start, f"{path.name}: no checklist heading"
    body = text[start.end() :]
    end = re.search(r"^#+ ", body, re.MULTILINE)
    steps = STEP.findall(body[: end.start() if end else None])
    assert [int(n) for n, _ in steps] == list(range(1, len(steps) + 1)), f"{path.name}: steps out of order"
    return [title for _, title in steps]


def test_deploy_readme_and_the_deploy_guide_give_one_checklist() -> None:
    steps = checklist(DEPLOY_README)
    assert steps == checklist(DEPLOY_GUIDE)
    for must in ("Namespace", "images", "Trust", "Metrics", "Check", "Apply", "Verify"):
        assert any(must in step for step in steps), must


@pytest.mark.parametrize("path", [DEPLOY_README, DEPLOY_GUIDE], ids=lambda p: p.name)
def test_checklist_runs_the_check_command_in_the_decode_pod(path: Path) -> None:
    text = " ".join(path.read_text().replace("\\\n", " ").split())  # shell continuations joined
    assert "Run `kv-release-sidecar check` with the same config" in text
    assert CHECK_MARKER not in text
    match = CHECK_COMMAND.search(text)
    assert match, "no kubectl exec ... kv-release-sidecar check --config FILE"
    namespace, deployment, name, config = match.groups()
    resources = rendered("sidecar")
    owner = find(resources, "Deployment", deployment)
    assert owner is not None and owner["metadata"]["namespace"] == namespace
    pod = Pod(owner)
    (container,) = [c for c in pod.sidecars() if c["name"] == name]
    assert config == config_file_path(container)  # the file serve reads, where the pod mounts it
    assert config_file_text(resources, pod, container)
    assert re.search(r"Exit code 0\b[^.]{0,80}\b1\b[^.]{0,80}\b2\b", text), "the exit codes, in one sentence"


@pytest.mark.parametrize("path", [DEPLOY_README, DEPLOY_GUIDE], ids=lambda p: p.name)
def test_checklist_names_the_trust_secret_and_the_podmonitor_prerequisite(path: Path) -> None:
    text = " ".join(path.read_text().split())
    for must in (
        "kv-release-sidecar-trust",
        "Prometheus Operator",
        "/readyz",
        "kvr_releases_total",
        "loadtest",
    ):
        assert must in text, must
    for front in ("llm-d", "vLLM's", "router", "gateway"):
        assert front in text, front


def _dockerfile_blocks(path: Path) -> list[list[tuple[str, str]]]:
    blocks = re.findall(r"```dockerfile\n(.*?)```", path.read_text(), re.DOTALL)
    parsed = []
    for block in blocks:
        tmp = path.parent / ".block.Dockerfile"
        try:
            tmp.write_text(block)
            parsed.append(dockerfile_instructions(tmp))
        finally:
            tmp.unlink(missing_ok=True)
    return parsed


def test_plugin_docs_show_the_plugin_dockerfile() -> None:
    (block,) = _dockerfile_blocks(DOCS / "control-endpoint.md")
    assert block == dockerfile_instructions(PLUGIN_DOCKERFILE)


@pytest.mark.parametrize("path", GUIDES, ids=lambda p: p.name)
def test_no_guide_installs_the_project_from_an_index(path: Path) -> None:
    # Only a path (./kv-release-sidecar, <checkout>, a built wheel) installs this project.
    for line in path.read_text().splitlines():
        assert not re.search(r"kv-release-sidecar==|pip install (--\S+ )*kv-release-sidecar\b", line), line
