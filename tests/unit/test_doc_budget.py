"""The docs stay short enough to read: a word budget for the user docs and one for the contributors'.

The user docs are README.md and docs/*.md (not docs/dev/). Words are counted
as ``cat README.md docs/*.md | wc -w`` counts them: runs of non-whitespace.
Engineering records, evidence, rationale and long edge cases belong in
docs/dev/ (indexed by docs/dev/README.md), with a sentence and a link left on
the user page. docs/dev/ has a budget of its own (``cat docs/dev/*.md | wc -w``):
one page per subject, each figure the current one with its command, and a
dated run's raw tables left in git history.
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
USER_DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
WORD_BUDGET = 25_000
DEV_DOCS = sorted((ROOT / "docs" / "dev").glob("*.md"))
DEV_WORD_BUDGET = 25_000
PERFORMANCE_LINES = 300
WHERE = (
    "move engineering records, evidence, rationale and long edge cases to docs/dev/ "
    "(index them in docs/dev/README.md) and leave a sentence and a link on the user page"
)
DEV_WHERE = (
    "keep one page per subject, say each fact once and link it, give the current figure with its "
    "command, and leave a dated run's raw tables in git history (name the commit); never move the "
    "text into the user docs, which have a budget of their own"
)


def words(path: Path) -> int:
    return len(path.read_text(encoding="utf-8").split())


def test_the_user_docs_fit_the_word_budget() -> None:
    counts = {path.relative_to(ROOT).as_posix(): words(path) for path in USER_DOCS}
    total = sum(counts.values())
    largest = sorted(counts.items(), key=lambda item: -item[1])[:5]
    assert total <= WORD_BUDGET, (
        f"user docs are {total} words, over {WORD_BUDGET} (largest: {largest}): {WHERE}"
    )


def test_the_contributor_docs_fit_their_word_budget() -> None:
    counts = {path.name: words(path) for path in DEV_DOCS}
    total = sum(counts.values())
    largest = sorted(counts.items(), key=lambda item: -item[1])[:5]
    assert total <= DEV_WORD_BUDGET, (
        f"docs/dev/ is {total} words, over {DEV_WORD_BUDGET} (largest: {largest}): {DEV_WHERE}"
    )


def test_every_contributor_page_is_in_the_index() -> None:
    index = (ROOT / "docs" / "dev" / "README.md").read_text(encoding="utf-8")
    missing = [p.name for p in DEV_DOCS if p.name != "README.md" and f"]({p.name})" not in index]
    assert missing == [], f"docs/dev/README.md lists no line for {missing}: one line per page"


def test_the_performance_page_fits_its_line_budget() -> None:
    lines = len((ROOT / "docs" / "performance.md").read_text(encoding="utf-8").splitlines())
    assert lines <= PERFORMANCE_LINES, (
        f"docs/performance.md is {lines} lines, over {PERFORMANCE_LINES}: dated runs and profiles "
        "belong in git history; the method and current figures in docs/dev/performance.md"
    )


def test_the_budget_counts_what_wc_counts(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n| a | `b`<br>`c` |\n\ntwo  words\tand\nmore\n", encoding="utf-8")
    assert words(page) == 11  # wc -w: "#", "Title", three "|"s, "a", the cell, four words
    assert "README.md" in {path.name for path in USER_DOCS}
    assert all(path.parent.name != "dev" for path in USER_DOCS)
    assert {"README.md", "architecture.md"} <= {path.name for path in DEV_DOCS}
    assert all(path.parent.name == "dev" for path in DEV_DOCS)
