"""The tests' own layout: one support package, fixtures in ``conftest.py``, no test module imported.

A helper that two suites share lives in ``tests/support/``; one that a single suite uses may sit
beside it in a module that holds no test. A test module imported by another ties the two together
(a rename in one breaks the other, and ``pytest -k`` on one collects the other's module), and a
``conftest.py`` is pytest's to load, not a module to import from. The scan also finds a second port
picker or a second ``until``: helpers written again beside a test are how the copies came back.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]
ROOT = TESTS.parent
# A test of a conftest's own hooks imports that conftest: what it tests, not a helper.
HOOK_TESTS = {("tests/conformance/test_ci_skips.py", "tests.conformance.conftest")}
# What polls (``until``, ``wait_until``, ``wait_for``, ...) and what picks a port, by name.
POLLER = re.compile(r"^_?(until|wait_until|wait_for|_until)(_async)?$")
PORT_PICKER = re.compile(r"^_?(free|closed|unused|ephemeral|pick)_?ports?$")


def _python(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.py") if "__pycache__" not in p.parts)


def _name(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts)


def _imported(path: Path) -> set[str]:
    """The modules ``path`` imports, each ``from a import b`` also as ``a.b`` (a module or a name)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def _is_test_module(module: str) -> bool:
    last = module.rsplit(".", 1)[-1]
    return module.startswith("tests.") and (last.startswith("test_") or last == "conftest")


def _defined(root: Path, pattern: re.Pattern[str]) -> list[str]:
    """Every function in ``root`` named by ``pattern``, as ``path:line name``."""
    found = []
    for path in _python(root):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and pattern.match(node.name):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}")
    return found


def test_no_module_of_the_tests_or_the_benches_imports_a_test_module_or_a_conftest() -> None:
    offending = [
        f"{path.relative_to(ROOT)} imports {module}"
        for path in _python(TESTS) + _python(ROOT / "bench")
        for module in sorted(_imported(path))
        if _is_test_module(module)
        and module != _name(path)
        and (str(path.relative_to(ROOT)), module) not in HOOK_TESTS
    ]
    assert offending == []


def test_one_until_and_one_port_picker() -> None:
    """``until`` (with its event loop form) and ``free_port`` are defined once: in the support
    package for the tests and the benches, and nowhere in the package (the demo holds a refusing
    socket instead)."""
    trees = (TESTS, ROOT / "sidecar", ROOT / "bench")
    pollers = [entry for tree in trees for entry in _defined(tree, POLLER)]
    pickers = [entry for tree in trees for entry in _defined(tree, PORT_PICKER)]
    assert [entry.split(":")[0] for entry in pollers] == ["tests/support/until.py"] * 2, pollers
    assert [entry.split(":")[0] for entry in pickers] == ["tests/support/ports.py"], pickers


@pytest.mark.parametrize(
    ("source", "imports"),
    [
        ("from tests.integration.test_router import pd\n", True),
        ("from tests.integration.conftest import run_sidecar\n", True),
        ("import tests.unit.test_proxy\n", True),
        ("from tests.integration import test_router\n", True),
        ("from tests.support.runner import run_sidecar\n", False),
        ("from tests.faults.cluster import Backends\n", False),
    ],
)
def test_the_scan_sees_each_way_of_importing_a_test_module(
    tmp_path: Path, source: str, imports: bool
) -> None:
    path = tmp_path / "test_x.py"
    path.write_text(source)
    assert any(_is_test_module(module) for module in _imported(path)) is imports
