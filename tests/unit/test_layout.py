"""The package's shape stays one a maintainer can hold: small modules, short functions, few parameters.

Limits for ``sidecar/`` (the simulators and the load generator aside, which
are tools rather than the service): a module is at most 400 lines, a function
at most 60 (metric declarations aside: one collector is several lines and
they belong together), and no function takes more than 6 parameters besides
``self``/``cls``. ``classify`` (the release table) is called from one module.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "sidecar"
TOOLS = ("sim", "loadtest")
MAX_MODULE, MAX_FUNCTION, MAX_PARAMS = 400, 60, 6
# Functions that only declare Prometheus collectors, one after another.
DECLARATIONS = {("metrics.py", "__init__"), ("nixl/metrics.py", "__init__")}


def modules() -> list[Path]:
    return [p for p in sorted(PACKAGE.rglob("*.py")) if p.relative_to(PACKAGE).parts[0] not in TOOLS]


def functions(tree: ast.AST) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    return [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]


def name(path: Path) -> str:
    return str(path.relative_to(PACKAGE))


@pytest.mark.parametrize("path", modules(), ids=name)
def test_module_size(path: Path) -> None:
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_MODULE, f"{name(path)}: {lines} lines"


@pytest.mark.parametrize("path", modules(), ids=name)
def test_functions_are_short_and_take_few_parameters(path: Path) -> None:
    problems = []
    for fn in functions(ast.parse(path.read_text())):
        length = (fn.end_lineno or fn.lineno) - fn.lineno + 1
        if length > MAX_FUNCTION and (name(path), fn.name) not in DECLARATIONS:
            problems.append(f"{fn.name}: {length} lines")
        args = [*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs]
        count = len([a for a in args if a.arg not in ("self", "cls")])
        if count > MAX_PARAMS:
            problems.append(f"{fn.name}: {count} parameters")
    assert not problems, f"{name(path)}: {problems}"


def test_classify_is_called_from_one_module() -> None:
    callers = set()
    for path in modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "classify":
                callers.add(name(path))
    assert callers == {"proxy/judge.py"}
