"""A missing extra's line says how to get it where the sidecar runs: pip, or the image's build argument."""

from __future__ import annotations

from pathlib import Path

import pytest

from sidecar import extras
from sidecar.extras import IMAGE_MARKER, MissingExtra, hint


def test_outside_the_image_the_hint_is_the_install_command(tmp_path: Path) -> None:
    assert hint("otel", str(tmp_path)) == 'pip install "<checkout>[otel]"'
    assert "README.md" in hint("nixl", str(tmp_path))


@pytest.mark.parametrize(
    ("built", "extra", "expected"),
    [
        ("nixl llm-d", "otel", 'rebuild the image with --build-arg EXTRAS="nixl llm-d otel"'),
        ("nixl otel", "llm-d", 'rebuild the image with --build-arg EXTRAS="nixl otel llm-d"'),
        ("", "nixl", 'rebuild the image with --build-arg EXTRAS="nixl"'),
        ("nixl llm-d otel", "loadtest", "it is in the loadtest image: docker build --target loadtest ."),
        ("loadtest", "nixl", "it is in the sidecar image: docker build ."),
    ],
)
def test_in_the_image_the_hint_names_the_build_argument(
    tmp_path: Path, built: str, extra: str, expected: str
) -> None:
    (tmp_path / IMAGE_MARKER).write_text(built + "\n")
    assert hint(extra, str(tmp_path)) == expected


def test_the_error_line_in_the_image_never_says_pip(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / IMAGE_MARKER).write_text("nixl llm-d\n")
    monkeypatch.setattr(extras.sys, "prefix", str(tmp_path))
    message = str(MissingExtra("--tracing", "otel", "opentelemetry.sdk"))
    assert message == (
        "--tracing needs the otel extra, which is not installed (no module opentelemetry.sdk): "
        'rebuild the image with --build-arg EXTRAS="nixl llm-d otel"'
    )
    assert "pip" not in message
