"""The package's shape stays one a maintainer can hold: layers, small modules, short functions.

Limits for ``sidecar/``: a module is at most 800 lines, the simulators and
the load generator included (split a module by concept, never to fit a
number: past about 800 lines one usually holds two); outside those tools
(rather than the service) a function is at most 60 (metric declarations
aside: one collector is several lines and they belong together), and no
function takes more than 6 parameters besides ``self``/``cls``.
``classify`` (the release table) is called from one module.

The layers: at most 12 modules at the top of ``sidecar/``, the rest in
packages; no import cycle between the packages and top-level modules, an
import under ``if TYPE_CHECKING:`` included (a type named from a layer above
is an arrow pointing up all the same), and none between the modules of one
package, a lazy import included (one named loop left); nothing outside the
tools imports the tools (``sidecar.sim``, ``sidecar.loadtest``) or
``bench``; and importing the serving path loads neither them nor the
libraries only tools and tests use.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "sidecar"
TOOLS = ("sim", "loadtest")
MAX_MODULE, MAX_FUNCTION, MAX_PARAMS = 800, 60, 6
# Functions that only declare Prometheus collectors, one after another.
DECLARATIONS = {("observability/metrics.py", "__init__"), ("nixl/metrics.py", "__init__")}


def modules() -> list[Path]:
    return [p for p in sorted(PACKAGE.rglob("*.py")) if p.relative_to(PACKAGE).parts[0] not in TOOLS]


def functions(tree: ast.AST) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    return [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]


def name(path: Path) -> str:
    return str(path.relative_to(PACKAGE))


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=name)
def test_module_size(path: Path) -> None:  # the tools included
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
    assert callers == {"decision/judge.py"}


# --- layers --------------------------------------------------------------------------------------

MAX_TOP_LEVEL = 12
# What the serving path must never load: the tools, bench, and libraries only they or the
# tests use (httpx serves ``check`` and the tests; the sidecar talks to D with its own client).
NOT_SERVING = ("sidecar.sim", "sidecar.loadtest", "bench", "matplotlib", "aiohttp", "httpx")


def _unit(module: str) -> str:
    """``sidecar.a.b`` -> ``a``: the top-level package or module a module belongs to."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "sidecar" else parts[0]


def _runtime_imports(tree: ast.AST, typing: bool = False) -> set[str]:
    """Modules imported by ``tree`` when it runs (``if TYPE_CHECKING:`` blocks skipped unless
    ``typing``: then those imports count too)."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if not typing and isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            if isinstance(child, ast.ImportFrom) and child.module and not child.level:
                base = child.module
                found.update(f"{base}.{a.name}" if base == "sidecar" else base for a in child.names)
            elif isinstance(child, ast.Import):
                found.update(a.name for a in child.names)
            visit(child)

    visit(tree)
    return found


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """Edges between the units of ``sidecar`` (a package or a top-level module), type-only
    imports included."""
    edges: dict[str, set[str]] = defaultdict(set)
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package.parent).with_suffix("").parts
        source = _unit(".".join(parts)) if len(parts) > 2 or parts[-1] != "__init__" else ""
        for module in _runtime_imports(ast.parse(path.read_text()), typing=True):
            target = _unit(module) if module.startswith("sidecar.") else ""
            if source and target and target != source:
                edges[source].add(target)
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one unit (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def strong(unit: str) -> None:
        index[unit] = low[unit] = len(index)
        stack.append(unit)
        for target in sorted(edges.get(unit, ())):
            if target not in index:
                strong(target)
                low[unit] = min(low[unit], low[target])
            elif target in stack:
                low[unit] = min(low[unit], index[target])
        if low[unit] == index[unit]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == unit:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for unit in sorted(edges):
        if unit not in index:
            strong(unit)
    return found


def test_no_import_cycle_between_packages() -> None:
    assert cycles(import_graph()) == []


def test_control_a_cycle_is_found() -> None:
    assert cycles({"proxy": {"router"}, "router": {"proxy", "upstream"}, "upstream": set()}) == [
        ["proxy", "router"]
    ]


def test_control_a_type_only_import_counts(tmp_path: Path) -> None:
    package = tmp_path / "sidecar"
    (package / "low").mkdir(parents=True)
    (package / "high").mkdir()
    (package / "__init__.py").write_text("")
    (package / "low" / "__init__.py").write_text("")
    (package / "high" / "__init__.py").write_text("")
    (package / "high" / "a.py").write_text("from sidecar.low.b import B\n")
    (package / "low" / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from sidecar.high.a import A\nB = 1\n"
    )
    assert cycles(import_graph(package)) == [["high", "low"]]


def _imported_modules(tree: ast.AST, known: set[str]) -> set[str]:
    """The modules of ``known`` that ``tree`` imports anywhere (in functions and under
    ``if TYPE_CHECKING:`` too): ``from a import b`` names ``a.b`` when that is a module, else ``a``."""
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                found.add(
                    f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in known else node.module
                )
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found & known


def module_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """Edges between the modules of each package of ``sidecar`` (a lazy import included)."""
    paths = {}
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package.parent).with_suffix("").parts
        paths[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    edges: dict[str, set[str]] = defaultdict(set)
    for module, path in paths.items():
        for target in _imported_modules(ast.parse(path.read_text()), set(paths)):
            if target != module and _unit(target) == _unit(module):
                edges[module].add(target)
    return edges


# ``Config`` checks itself when made (``__post_init__`` calls ``rules.check``), and the rules
# read the config's constants: the one loop inside a package left.
KNOWN_LOOPS = [["sidecar.config", "sidecar.config.rules", "sidecar.config.settings"]]


def test_no_import_loop_inside_a_package() -> None:
    assert cycles(module_graph()) == KNOWN_LOOPS


def test_control_a_lazy_import_loop_is_found(tmp_path: Path) -> None:
    package = tmp_path / "sidecar"
    (package / "obs").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "obs" / "__init__.py").write_text("")
    (package / "obs" / "base.py").write_text("def build():\n    from sidecar.obs.sdk import Sdk\n")
    (package / "obs" / "sdk.py").write_text("from sidecar.obs.base import build\n")
    assert cycles(module_graph(package)) == [["sidecar.obs.base", "sidecar.obs.sdk"]]


# The release decision (docs/dev/architecture.md, "The release decision") and what router mode may
# import of the proxy: the request's context, the answers, the disconnect watcher and the usage
# correction, never the handler or the proxy's parts (the proxy's admission step reaches router mode
# through the small ``Admission`` protocol router mode declares, the app joining the two).
DECISION = ("decision", "classify", "retries")
REQUEST_PATH = ("proxy", "router", "app")
ROUTER_USES = {"answers", "context", "disconnect", "usage"}


def _imports_of(path: Path) -> set[str]:
    return {m for m in _runtime_imports(ast.parse(path.read_text()), typing=True) if m.startswith("sidecar.")}


def test_the_decision_imports_nothing_of_the_request_path() -> None:
    offenders = [
        f"{name(path)} imports {module}"
        for path in modules()
        if path.relative_to(PACKAGE).parts[0].removesuffix(".py") in DECISION
        for module in _imports_of(path)
        if _unit(module) in REQUEST_PATH
    ]
    assert offenders == []


def test_the_request_path_enters_the_judge_from_one_module() -> None:
    callers = set()
    for path in modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "judge"
            ):
                callers.add(name(path))
    # the forwarder (``Forwarder.judged``), and a stream judged from its first event (``StreamJudge``)
    assert callers == {"proxy/handler.py", "decision/judge.py"}


def test_router_mode_uses_the_proxy_only_through_its_admission_step() -> None:
    used = {
        module.split(".")[2]
        for path in (PACKAGE / "router").glob("*.py")
        for module in _imports_of(path)
        if _unit(module) == "proxy" and module.count(".") >= 2
    }
    bare = [name(p) for p in (PACKAGE / "router").glob("*.py") if "sidecar.proxy" in _imports_of(p)]
    legs = ast.parse((PACKAGE / "router" / "legs.py").read_text())
    seam = [n for n in ast.walk(legs) if isinstance(n, ast.ClassDef) and n.name == "Admission"]
    steps = {f.name for f in functions(seam[0])} if seam else set()
    assert used <= ROUTER_USES and "handler" not in used and bare == []
    assert steps == {"admit", "alone", "prefilled", "abandoned", "unsent"}  # the one small seam


def test_at_most_twelve_modules_at_the_top() -> None:
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL, top


def test_nothing_but_the_tools_imports_the_tools() -> None:
    offenders = []
    for path in modules():
        for module in _runtime_imports(ast.parse(path.read_text())):
            if module.startswith(("sidecar.sim", "sidecar.loadtest", "bench")):
                offenders.append(f"{name(path)} imports {module}")
    assert offenders == []


def test_the_serving_path_loads_no_tool_and_no_client_library() -> None:
    code = (
        "import sys, sidecar.cli, sidecar.server.serve, sidecar.app; "
        f"print(sorted({{m for m in sys.modules if m.startswith({NOT_SERVING!r})}}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
