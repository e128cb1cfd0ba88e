"""``make mutate``'s report reads the page that lists the equivalent survivors, in the form it prints.

``tests/mutation_report.py`` fails ``make mutate`` on every survivor its page
does not name, so the page must exist, name each survivor as mutmut does, and
keep the table in the shape the report prints it.
"""

from __future__ import annotations

import re
from pathlib import Path

from tests import mutation_report

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / mutation_report.DOCS
NAME = re.compile(r"`(sidecar\.[\w.]+\.x[_\u01c1]\S*?__mutmut_\d+)`")


def test_the_page_lists_the_survivors_in_the_form_mutmut_names_them() -> None:
    text = PAGE.read_text(encoding="utf-8")
    listed = text[text.index("### Surviving mutants, each equivalent") :]
    names = NAME.findall(listed)
    assert names, f"{PAGE.relative_to(ROOT)} lists no surviving mutant"
    results = mutation_report.parse([f"    {name}: survived" for name in names])
    assert sorted(results) == sorted(set(names))
    assert mutation_report.unaccounted(results, text) == []


def test_the_page_keeps_the_table_the_report_prints() -> None:
    header = mutation_report.table({}).splitlines()[:2]
    assert "\n".join(header) in PAGE.read_text(encoding="utf-8")


def test_a_survivor_the_page_does_not_name_is_reported() -> None:
    lines = [
        "    sidecar.classify.x_classify__mutmut_4: survived",
        "    sidecar.classify.x_classify__mutmut_999: survived",
        "    sidecar.classify.x_classify__mutmut_5: killed",
        "    sidecar.retries.x_retried__mutmut_1: no tests",
    ]
    results = mutation_report.parse(lines)
    assert mutation_report.unaccounted(results, "`sidecar.classify.x_classify__mutmut_4`") == [
        "sidecar.classify.x_classify__mutmut_999",
        "sidecar.retries.x_retried__mutmut_1",
    ]
    assert "| `sidecar.classify` | 1 | 2 | 0 | 0 | 0 | 3 | 33.3 |" in mutation_report.table(results)
