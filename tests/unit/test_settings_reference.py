"""docs/settings.md is what ``sidecar.config.reference`` makes of ``Config`` now."""

from __future__ import annotations

from pathlib import Path

import msgspec

from sidecar.config import Config
from sidecar.config.reference import COMMAND, render

PAGE = Path(__file__).resolve().parents[2] / "docs" / "settings.md"


def test_the_settings_page_is_generated_from_config() -> None:
    assert PAGE.read_text(encoding="utf-8") == render(), (
        f"docs/settings.md differs from Config: regenerate it with `.venv/bin/{COMMAND}`"
    )


def test_every_field_has_one_row_with_its_flag_variable_and_default() -> None:
    lines = render().splitlines()
    for field in msgspec.structs.fields(Config):
        flag, variable = "--" + field.name.replace("_", "-"), "KVR_" + field.name.upper()
        (line,) = [line for line in lines if line.startswith(f"| `{field.name}` |")]
        assert f"`{flag}`<br>`{variable}`" in line
    for shown in (
        "| `release` | `--release`<br>`KVR_RELEASE` | `dry-run` |",
        "| `retried_statuses` | `--retried-statuses`<br>`KVR_RETRIED_STATUSES` | `502,503,504` |",
        "| `release_ambiguous` | `--release-ambiguous`<br>`KVR_RELEASE_AMBIGUOUS` | `false` |",
    ):
        assert any(line.startswith(shown) for line in lines), shown
