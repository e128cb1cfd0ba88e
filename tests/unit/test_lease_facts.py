"""How long P holds an unreleased request's blocks, as the pages say it, is ``sidecar.release.hold``'s table.

Every user page (README.md, docs/*.md, docs/alerts.yaml) that states P's
deadline in older releases (a "480 s" or "120 s") states the whole table as
``deadlines_text()`` renders it, so a page cannot keep "480 s before 0.22.0"
or "120 s in 0.10.x" after the code knows better. The simulated P's default
lease (``sidecar.sim.prefill``, written apart from the sidecar as a model of
vLLM) agrees with the table release by release.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from sidecar.nixl.versions import RELEASES
from sidecar.release.hold import DEADLINES, deadline_of, hold_seconds, lease_seconds
from sidecar.sim.prefill.release import release_for

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "docs" / "alerts.yaml"]
OLDER = re.compile(r"\b(480|120) s\b")


def deadlines_text() -> str:
    """``DEADLINES`` as one phrase, newest first, as the docs state it (found on every page that
    says how long P holds the blocks)."""
    parts = []
    for deadline in reversed(DEADLINES):
        since = ".".join(map(str, deadline.since))
        if deadline.seconds is None:
            parts.append("none before")
        else:
            parts.append(f"{deadline.seconds:g} s from {'vLLM ' if not parts else ''}{since}")
    return ", ".join(parts)


def flat(text: str) -> str:
    """``text`` with YAML's folded lines, Markdown's wrapping and list markers undone."""
    return re.sub(r"\s+", " ", text)


def test_the_table_renders_newest_first() -> None:
    assert deadlines_text() == ("30 s from vLLM 0.22.0, 480 s from 0.11.1, 120 s from 0.10.0, none before")


@pytest.mark.parametrize(
    ("version", "hold", "lease"),
    [
        ("0.9.2", 480.0, None),  # no deadline: the saved-time estimate counts 480 s
        ("0.10.0", 120.0, 120.0),
        ("0.10.2", 120.0, 120.0),
        ("0.11.0", 120.0, 120.0),
        ("0.11.1", 480.0, 480.0),
        ("0.21.2", 480.0, 480.0),
        ("0.22.0", 30.0, 30.0),
        ("0.34.0", 30.0, 30.0),
        (None, 30.0, 30.0),  # unknown: the shortest
    ],
)
def test_each_span_of_the_table(version: str | None, hold: float, lease: float | None) -> None:
    assert hold_seconds(version) == hold
    assert lease_seconds(version) == lease


def test_the_simulated_p_holds_as_long_as_the_table_says() -> None:
    for release in RELEASES:
        assert release_for(".".join(map(str, release))).default_lease == deadline_of(release), release
    assert [d.since for d in DEADLINES] == sorted(d.since for d in DEADLINES)


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_every_page_states_the_whole_table(page: Path) -> None:
    text, table = flat(page.read_text()), deadlines_text()
    spans = [(m.start(), m.end()) for m in re.finditer(re.escape(table), text)]
    stray = [
        text[max(0, m.start() - 60) : m.end() + 40]
        for m in OLDER.finditer(text)
        if not any(start <= m.start() < end for start, end in spans)
    ]
    assert stray == [], f"{page.name}: P's deadline stated otherwise than {table!r}"
