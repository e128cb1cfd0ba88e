"""``make mutate``'s table: mutmut's results per module, and the survivors nobody accounted for.

Reads ``mutmut results --all true`` (one ``<mutant>: <status>`` line per
mutant; a mutant's name starts with its module), prints the score of each
module as the Markdown table docs/dev/testing.md keeps, then every surviving
mutant that docs/dev/testing.md does not name (each named one is listed there as
equivalent, with the reason). Exits 1 when one is left, so a new survivor
fails the target until a test kills it or its equivalence is written down.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

COLUMNS = ("killed", "survived", "timeout", "no tests")
_LINE = re.compile(r"^\s*(?P<name>(?P<module>[\w.]+)\.x[_\u01c1]\S*__mutmut_\d+): (?P<status>.+)$")
DOCS = Path("docs/dev/testing.md")


def parse(lines: list[str]) -> dict[str, tuple[str, str]]:
    """Mutant name -> (module, status)."""
    found: dict[str, tuple[str, str]] = {}
    for line in lines:
        match = _LINE.match(line)
        if match:
            found[match["name"]] = (match["module"], match["status"].strip())
    return found


def table(results: dict[str, tuple[str, str]]) -> str:
    by_module: dict[str, Counter[str]] = {}
    for module, status in results.values():
        by_module.setdefault(module, Counter())[status] += 1
    rows = ["| module | " + " | ".join(COLUMNS) + " | other | total | killed % |", "|---" * 8 + "|"]
    total: Counter[str] = Counter()
    for module in sorted(by_module):
        counts = by_module[module]
        total.update(counts)
        rows.append(_row(f"`{module}`", counts))
    rows.append(_row("all", total))
    return "\n".join(rows)


def _row(name: str, counts: Counter[str]) -> str:
    whole = sum(counts.values())
    other = whole - sum(counts[c] for c in COLUMNS)
    score = f"{100 * counts['killed'] / whole:.1f}" if whole else "-"
    cells = [str(counts[c]) for c in COLUMNS]
    return f"| {name} | " + " | ".join(cells) + f" | {other} | {whole} | {score} |"


def unaccounted(results: dict[str, tuple[str, str]], docs: str) -> list[str]:
    """Survivors (and mutants no test reached) that the docs do not name."""
    left = (name for name, (_, status) in results.items() if status in ("survived", "no tests"))
    return sorted(name for name in left if name not in docs)


def main() -> int:
    command = [sys.executable, "-m", "mutmut", "results", "--all", "true"]
    out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    results = parse(out.splitlines())
    if not results:
        print("mutation report: mutmut has no results (run mutmut run first)", file=sys.stderr)
        return 1
    print(table(results))
    left = unaccounted(results, DOCS.read_text(encoding="utf-8") if DOCS.exists() else "")
    if left:
        print(f"\n{len(left)} surviving mutants are neither killed nor listed in {DOCS}:")
        print("\n".join(f"  {name}" for name in left))
        return 1
    print(f"\nevery surviving mutant is listed in {DOCS} as equivalent")
    return 0


if __name__ == "__main__":
    sys.exit(main())
