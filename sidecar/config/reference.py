"""The settings reference, docs/settings.md, generated from ``Config`` and its ``--help`` lines.

``python -m sidecar.config.reference > docs/settings.md`` writes it: one row
per ``Config`` field in declaration order, with its TOML key, flag,
``KVR_*`` variable, default and help text (``sidecar.config.help``), so the
page says exactly what ``serve --help`` says. ``tests/unit/
test_settings_reference.py`` fails when the page and ``Config`` drift apart.
"""

from __future__ import annotations

import sys
from typing import Any

import msgspec

from sidecar.config.help import HELP
from sidecar.config.settings import ENV_PREFIX, OTHER_ENV, Config

COMMAND = "python -m sidecar.config.reference > docs/settings.md"

INTRO = f"""# Settings reference

Generated from `Config` (`sidecar/config/settings.py`) by `{COMMAND}`;
edit the code, not this page. [configuration.md](configuration.md) has the
rules (precedence, durations, lists) and the settings most deployments set.
Each setting is a flag, a `KVR_*` variable and a key of the TOML file named
by `--config` (env `{ENV_PREFIX}CONFIG`).

| TOML key | flag, variable | default | what it does |
| --- | --- | --- | --- |
"""


def default_text(value: Any) -> str:
    """A field's default as the page shows it."""
    if isinstance(value, bool):
        return "`true`" if value else "`false`"
    if isinstance(value, tuple):
        return "`" + ",".join(map(str, value)) + "`" if value else "empty"
    if value is None or value == "":
        return "empty"
    if isinstance(value, float):
        return f"`{value:g}`"
    return f"`{value}`"


def row(name: str, default: Any) -> str:
    text, unit = HELP[name]
    what = f"{text} ({unit})" if unit else text
    flag, variable = "--" + name.replace("_", "-"), ENV_PREFIX + name.upper()
    cells = [f"`{name}`", f"`{flag}`<br>`{variable}`", default_text(default), what.replace("|", "\\|")]
    return "| " + " | ".join(cells) + " |"


def render() -> str:
    """The whole page."""
    rows = [row(f.name, f.default) for f in msgspec.structs.fields(Config)]
    others = "\n".join(f"- `{name}`: {what}." for name, what in sorted(OTHER_ENV.items()))
    tail = f"\n\nOther `{ENV_PREFIX}*` variables the same install reads:\n\n{others}\n"
    return INTRO + "\n".join(rows) + tail


def main() -> None:
    sys.stdout.write(render())


if __name__ == "__main__":
    main()
