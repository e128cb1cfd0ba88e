"""The renderer the deploy tests use is kustomize 5 itself, and says what to install when it is missing."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.deploy import render


def _fake_kubectl(bin_dir: Path, kustomize_version: str) -> None:
    script = bin_dir / "kubectl"
    script.write_text(
        f"#!/bin/sh\necho 'Client Version: v1.20.2'\necho 'Kustomize Version: {kustomize_version}'\n"
    )
    script.chmod(script.stat().st_mode | stat.S_IXUSR)


@pytest.fixture
def isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A PATH and a .tools/bin holding nothing but what the test puts in ``tmp_path``."""
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(render, "TOOLS_BIN", tmp_path / "tools-bin")
    render.command.cache_clear()
    yield tmp_path
    render.command.cache_clear()


def test_without_kustomize_or_kubectl_rendering_fails_saying_what_to_install(isolated: Path) -> None:
    with pytest.raises(render.RenderError, match="make tools"):
        render.command()


def test_a_kubectl_embedding_kustomize_older_than_5_is_not_used(isolated: Path) -> None:
    _fake_kubectl(isolated, "v2.0.3")  # Debian bookworm's kubernetes-client 1.20
    with pytest.raises(render.RenderError, match="kustomize 5"):
        render.command()


def test_kubectl_in_tools_bin_is_found(isolated: Path) -> None:
    tools_bin = isolated / "tools-bin"
    tools_bin.mkdir()
    _fake_kubectl(tools_bin, "v5.8.1")
    assert render.command() == (str(tools_bin / "kubectl"), "kustomize")


def test_the_installed_renderer_is_kustomize_5_and_reports_its_errors(tmp_path: Path) -> None:
    assert os.path.basename(render.command()[0]) in ("kustomize", "kubectl")
    (tmp_path / "kustomization.yaml").write_text("resources:\n  - missing.yaml\n")
    with pytest.raises(render.RenderError, match=r"missing\.yaml"):
        render.build(tmp_path)
