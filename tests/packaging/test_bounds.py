"""Bounds that follow evidence: no dependency is held below a release without a reason written beside it.

An upper bound on a runtime dependency (the core's or an extra's: ``<``, ``<=``,
``==``, ``~=``, ``!=``) keeps users from a release; someone who installs the
sidecar beside a package needing that release gets a resolver conflict. So
one is allowed only with a comment beside it (on its line, or the comment
lines right above) naming the test that fails on the release it excludes, as
``tests/path.py::test_name``, and that test must exist. A bound in the dev
group keeps only the project's own tools back: it needs a comment saying why.
``make deps-release`` (docs/testing.md, "When a dependency releases") is how a
bound is found to be unneeded.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]
EXCLUDING = frozenset({"<", "<=", "==", "===", "~=", "!="})  # operators that keep some newer release out
NAMED_TEST = re.compile(r"(tests/[\w/]+\.py)::(\w+)")


@dataclass(frozen=True)
class Bound:
    group: str  # "dependencies", "optional:<extra>" or "dev"
    requirement: str
    comment: str  # the comment text beside it ("" if none)


def bounds(text: str) -> list[Bound]:
    """Every requirement of ``text`` (a pyproject.toml) that excludes a newer release, with its comment."""
    data = tomllib.loads(text)
    groups = {"dependencies": data["project"].get("dependencies", [])}
    for extra, requirements in data["project"].get("optional-dependencies", {}).items():
        groups[f"optional:{extra}"] = requirements
    groups["dev"] = [r for r in data.get("dependency-groups", {}).get("dev", []) if isinstance(r, str)]
    lines = text.splitlines()
    found = []
    for group, requirements in groups.items():
        for requirement in requirements:
            if any(spec.operator in EXCLUDING for spec in Requirement(requirement).specifier):
                found.append(Bound(group, requirement, _comment(lines, requirement)))
    return found


def _comment(lines: list[str], requirement: str) -> str:
    """The comment on ``requirement``'s line and the comment lines right above it."""
    quoted = f'"{requirement}"'
    for index, line in enumerate(lines):
        if quoted in line:
            parts = [line.partition("#")[2].strip()] if "#" in line.split(quoted, 1)[1] else []
            above = index - 1
            while above >= 0 and lines[above].strip().startswith("#"):
                parts.insert(0, lines[above].strip().lstrip("#").strip())
                above -= 1
            return " ".join(part for part in parts if part)
    return ""


def problems(found: list[Bound], root: Path = ROOT) -> list[str]:
    """What is wrong with each bound: none for a runtime bound naming an existing failing test, or a
    dev bound with a reason."""
    wrong = []
    for bound in found:
        if bound.group == "dev":
            if not bound.comment:
                wrong.append(f"{bound.requirement} (dev): an upper bound with no reason beside it")
            continue
        named = NAMED_TEST.findall(bound.comment)
        if not named:
            wrong.append(
                f"{bound.requirement} ({bound.group}): an upper bound without the test that fails on "
                "the release it excludes (tests/path.py::test_name) in a comment beside it"
            )
        for path, test in named:
            source = root / path
            if not source.is_file() or not re.search(rf"def {test}\b", source.read_text()):
                wrong.append(f"{bound.requirement} ({bound.group}): names {path}::{test}, which is not there")
    return wrong


def test_every_upper_bound_in_pyproject_has_its_evidence_beside_it() -> None:
    found = bounds((ROOT / "pyproject.toml").read_text())
    assert problems(found) == []
    # what the rule allows today: the dev group's pytest, with its reason
    assert [b.requirement for b in found if b.group != "dev"] == []


PYPROJECT = """
[project]
name = "x"
dependencies = [
    "uvicorn>=0.34,<0.55",
    # tests/unit/test_bounds_fixture.py::test_breaks fails on 2.0
    "httpx>=0.28,<2",
    "msgspec!=0.20.0",  # tests/unit/test_gone.py::test_gone
    "starlette>=0.46",
]
[project.optional-dependencies]
nixl = ["pyzmq==27.3.0"]
[dependency-groups]
dev = [
    "pytest>=8.3,<9.2",  # 9.2 made node ids read-only
    "ruff<1",
    "mypy>=1.13",
]
"""


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    (tmp_path / "tests" / "unit").mkdir(parents=True)
    (tmp_path / "tests" / "unit" / "test_bounds_fixture.py").write_text("def test_breaks():\n    pass\n")
    return tmp_path


def test_bounds_are_found_with_the_comments_beside_them() -> None:
    found = {b.requirement: b for b in bounds(PYPROJECT)}
    assert set(found) == {
        "uvicorn>=0.34,<0.55", "httpx>=0.28,<2", "msgspec!=0.20.0", "pyzmq==27.3.0",
        "pytest>=8.3,<9.2", "ruff<1",
    }  # fmt: skip
    assert found["uvicorn>=0.34,<0.55"].comment == ""
    assert found["httpx>=0.28,<2"].comment.startswith("tests/unit/test_bounds_fixture.py::test_breaks")
    assert found["msgspec!=0.20.0"].comment == "tests/unit/test_gone.py::test_gone"
    assert (found["pyzmq==27.3.0"].group, found["pytest>=8.3,<9.2"].group) == ("optional:nixl", "dev")


def test_a_bound_without_a_named_existing_test_is_refused(tree: Path) -> None:
    wrong = problems(bounds(PYPROJECT), tree)
    assert wrong == [
        "uvicorn>=0.34,<0.55 (dependencies): an upper bound without the test that fails on the release it "
        "excludes (tests/path.py::test_name) in a comment beside it",
        "msgspec!=0.20.0 (dependencies): names tests/unit/test_gone.py::test_gone, which is not there",
        "pyzmq==27.3.0 (optional:nixl): an upper bound without the test that fails on the release it "
        "excludes (tests/path.py::test_name) in a comment beside it",
        "ruff<1 (dev): an upper bound with no reason beside it",
    ]
