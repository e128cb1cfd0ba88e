"""``--help`` explains every setting: one plain-text line with its unit, default and variable.

The lines come from ``sidecar.config.help.HELP``. A field
added without a line there, or a number without a unit, fails here.
"""

from __future__ import annotations

import argparse
import re
from typing import Any, get_args, get_origin

import msgspec
import pytest

from sidecar import cli
from sidecar.config import HELP, Config, build_parser, help_line

FIELDS = msgspec.structs.fields(Config)


def _is_number(type_: Any) -> bool:
    inner = [t for t in get_args(type_) if t is not type(None)] or [type_]
    if get_origin(type_) is tuple:
        inner = [get_args(type_)[0]]
    return any(t in (int, float) for t in inner)


def test_every_field_has_a_help_line_and_nothing_else_does() -> None:
    missing = [f.name for f in FIELDS if f.name not in HELP]
    assert not missing, f"add a line to sidecar.config.HELP for {missing}"
    assert set(HELP) == {f.name for f in FIELDS}, "HELP names a field Config does not have"


@pytest.mark.parametrize("field", FIELDS, ids=lambda f: f.name)
def test_each_line_is_one_plain_line_with_a_unit_where_one_applies(field: msgspec.structs.FieldInfo) -> None:
    text, unit = HELP[field.name]
    assert text and "\n" not in text + unit and "`" not in text + unit
    if _is_number(field.type):
        assert unit, f"{field.name} is a number: say its unit (seconds, bytes, ...)"
    if get_origin(field.type) is tuple:
        assert "list" in unit, f"{field.name} is a list: say so (comma-separated in flags and variables)"
    line = help_line(field.name, field.default)
    assert f"env KVR_{field.name.upper()}" in line and "default " in line


def test_help_renders_defaults_as_an_operator_reads_them() -> None:
    assert help_line("port", 8000) == (
        "proxy port: clients and routers send requests here (TCP port; 0 picks a free one; default 8000; "
        "env KVR_PORT)"
    )
    assert "default 0.05;" in help_line("release_retry_initial", 0.05)
    assert "default off;" in help_line("release_ambiguous", False)
    assert "default empty;" in help_line("prefill_allow", ())
    assert "default 503;" in help_line("inject_statuses", (503,))


def test_serve_help_lists_every_flag_with_its_line() -> None:
    wide = argparse.ArgumentParser(
        prog="serve", formatter_class=lambda prog: argparse.HelpFormatter(prog, width=500)
    )
    text = " ".join(build_parser(wide).format_help().split())
    for field in FIELDS:
        flag = "--" + field.name.replace("_", "-")
        assert flag in text
        assert " ".join(help_line(field.name, field.default).split()) in text, field.name


@pytest.mark.parametrize("command", [None, *cli.COMMANDS])
def test_no_help_prints_markup(command: str | None) -> None:
    parser = cli.build_parser(command)
    if command is not None:
        parser = next(
            action.choices[command]
            for action in parser._actions
            if isinstance(action, argparse._SubParsersAction)
        )
    text = parser.format_help()
    assert not re.search(r"``|:class:|:func:|\*\*", text), text
    assert "`" not in text
