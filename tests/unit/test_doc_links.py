"""Every relative link in README.md, docs/ and deploy/ Markdown reaches a file, and its #anchor a heading.

Links are read outside fenced code blocks and inline code; web links
(``https://``, ``mailto:``) are not followed. An anchor is checked against
the headings of the Markdown file it points into, slugged as GitHub slugs
them (lower case, punctuation dropped, spaces to hyphens, ``-1``, ``-2``
for repeats).
"""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted(
    [ROOT / "README.md", *(ROOT / "docs").rglob("*.md"), *(ROOT / "deploy").rglob("*.md")],
    key=lambda path: str(path),
)
FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)
CODE = re.compile(r"(`+)(?:(?!\1).)+?\1", re.DOTALL)
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.MULTILINE)
EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.IGNORECASE)


def prose(text: str) -> str:
    """``text`` without fenced blocks and inline code, where a link is not a link."""
    return CODE.sub("", FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading keeps its text
    text = re.sub(r"[^\w\- ]", "", text.lower(), flags=re.UNICODE)
    return text.replace(" ", "-")


@cache
def anchors(path: Path) -> frozenset[str]:
    seen: dict[str, int] = {}
    found = set()
    for heading in HEADING.findall(FENCE.sub("", path.read_text(encoding="utf-8"))):
        base = slug(heading)
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return frozenset(found)


def broken(page: Path) -> list[str]:
    problems = []
    for target in LINK.findall(prose(page.read_text(encoding="utf-8"))):
        if EXTERNAL.match(target):
            continue
        path_part, _, anchor = target.partition("#")
        linked = (page.parent / path_part).resolve() if path_part else page
        if not linked.exists():
            problems.append(f"{target}: no such file")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            problems.append(f"{target}: no heading #{anchor} in {linked.relative_to(ROOT)}")
    return problems


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_relative_links_reach_a_file_and_a_heading(page: Path) -> None:
    assert broken(page) == []


@pytest.mark.parametrize(
    ("heading", "anchor"),
    [
        ("More than one core: `workers`", "more-than-one-core-workers"),
        ("Deploying: the checklist", "deploying-the-checklist"),
        ("`n > 1`", "n--1"),
        ("P's lease", "ps-lease"),
        ("Retries in front of the decode pods", "retries-in-front-of-the-decode-pods"),
    ],
)
def test_slugs_are_githubs(heading: str, anchor: str) -> None:
    assert slug(heading) == anchor


def test_a_broken_link_and_a_missing_heading_are_found(tmp_path: Path) -> None:
    (tmp_path / "other.md").write_text("# Title\n\n## A section\n\n## A section\n")
    page = tmp_path / "page.md"
    page.write_text(
        "[ok](other.md#a-section) [ok](other.md#a-section-1) [ok](#here) [web](https://example.com/x)\n"
        "`[not a link](nowhere.md)`\n```\n[nor this](nowhere.md)\n```\n"
        "[gone](missing.md) [no anchor](other.md#nothing) [no such](#there)\n\n## Here\n"
    )
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        assert broken(page) == [
            "missing.md: no such file",
            "other.md#nothing: no heading #nothing in other.md",
            "#there: no heading #there in page.md",
        ]
    finally:
        ROOT = saved
