"""Docs, code comments and messages speak to readers outside the project's tracker.

No issue numbers ("issue 12"), no section numbers of an internal reference
document ("reference 1.4", "section 6.2") and no internal target names: each
such mention is rewritten to say what it means (the vLLM function, the
behaviour). The scan covers every text file a user or contributor reads.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TREES = ("sidecar", "tests", "bench", "docs", "deploy", "requirements")
FILES = ("README.md", "CHANGELOG.md", "Makefile", "Dockerfile", "pyproject.toml", ".dockerignore")
SUFFIXES = {".py", ".md", ".yaml", ".yml", ".toml", ".txt", ".json", ".Dockerfile", ""}
MENTION = re.compile(
    r"\bissues? #?\d+"  # a tracker issue
    r"|#\d+\b(?![\w.])"  # a tracker number written the short way
    r"|\breference,? (?:sections? )?\d+(?:\.\d+)*"  # a numbered part of an internal reference
    r"|(?<!RFC \d{4} )\bsections? \d+(?:\.\d+)*(?:-\d+(?:\.\d+)*)?\b"
    r"|\b(?:wire|nixl) reference\b"
    r"|\btargets? #?\d+\b",  # a numbered internal target
    re.IGNORECASE,
)
# Mentions still in files being rewritten on other branches (the release strategies and the
# simulators), at most this many each; delete an entry once its file is clean.
PENDING_ELSEWHERE: dict[str, int] = {}


def _files() -> list[Path]:
    found = [ROOT / name for name in FILES if (ROOT / name).exists()]
    for tree in TREES:
        found += [
            p
            for p in sorted((ROOT / tree).rglob("*"))
            if p.is_file() and p.suffix in SUFFIXES and "__pycache__" not in p.parts and not _vendored(p)
        ]
    return found


def _vendored(path: Path) -> bool:
    """An upstream file kept unchanged below its header (a test fixture), skipped whole: its
    comments are the upstream project's, which may cite its own tracker."""
    with path.open(errors="replace") as handle:
        return handle.readline().startswith(VENDORED)


VENDORED = "# Vendored test fixture"


def mentions(text: str) -> list[str]:
    return [m.group(0) for m in MENTION.finditer(text)]


@pytest.mark.parametrize(
    ("text", "found"),
    [
        ("as issue 2 defines them", True),
        ("see #12 for details", True),
        ("(reference 1.4): both payloads", True),
        ("the wire reference (sections 1.2-1.4)", True),
        ("vLLM's own fix (0.21.0+, reference section 5)", True),
        ("Hop-by-hop headers (RFC 9110 section 7.6.1)", False),
        ("vLLM's reference P/D proxy, toy_proxy_server.py", False),
        ("every target bootstraps its own environment", False),
        ("color #fff and item #1a", False),
    ],
)
def test_the_scan_tells_internal_mentions_from_ordinary_words(text: str, found: bool) -> None:
    assert bool(mentions(text)) is found


def test_no_internal_references_in_the_tree() -> None:
    this = Path(__file__).resolve()
    problems: dict[str, list[str]] = {}
    for path in _files():
        if path.resolve() == this:
            continue
        found = mentions(path.read_text(errors="replace"))
        name = str(path.relative_to(ROOT))
        if len(found) > PENDING_ELSEWHERE.get(name, 0):
            problems[name] = found
    assert not problems, problems
