"""``bench/`` has no import circle: none between its modules, none between its packages.

Every import counts, wherever it stands: at the top, inside a function (a
lazy import), or under ``if TYPE_CHECKING:`` (a type named from a module
that imports this one is a circle all the same). A package is a workload or
the shared parts (``bench/<package>/``); a module at the top of ``bench/``
is a unit of its own. A package's ``__init__.py`` holds its description and
imports nothing, so importing one module of a package runs no other.

Every bench lives in a package by workload; the top of ``bench/`` keeps only
``python -m bench`` itself (``__init__``, ``__main__`` and ``cli``, which reads
the flags of the workloads it runs). The shared parts (``harness``,
``servers``) import no workload.
"""

from __future__ import annotations

import ast
import graphlib
from collections import defaultdict
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"


def module_names(root: Path) -> dict[str, Path]:
    """Every module below ``root`` (a package named as its directory) by dotted name."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imported(path: Path, name: str, known: set[str]) -> set[str]:
    """The modules of ``known`` that module ``name`` (at ``path``) imports anywhere in it: ``from a
    import b`` names ``a.b`` when that is a module, else ``a``; a relative import is resolved."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            anchor = package[: len(package) - node.level + 1] if node.level else []
            base = ".".join([*anchor, *([node.module] if node.module else [])])
            found.update(f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return found & known


def module_graph(root: Path = BENCH) -> dict[str, set[str]]:
    """Edges between the modules of ``root``, each import counted."""
    modules = module_names(root)
    edges: dict[str, set[str]] = defaultdict(set)
    for name, path in modules.items():
        edges[name] |= imported(path, name, set(modules)) - {name}
    return edges


def unit(module: str, packages: set[str]) -> str:
    """``bench.streams.report`` -> ``bench.streams``: the package a module belongs to, or the
    top-level module itself."""
    parts = module.split(".")
    return ".".join(parts[:2]) if ".".join(parts[:2]) in packages else module


def package_graph(root: Path = BENCH) -> dict[str, set[str]]:
    """Edges between the packages (and top-level modules) of ``root``."""
    packages = {".".join(p.parent.relative_to(root.parent).parts) for p in root.glob("*/__init__.py")}
    edges: dict[str, set[str]] = defaultdict(set)
    for source, targets in module_graph(root).items():
        edges[unit(source, packages)] |= {unit(t, packages) for t in targets} - {unit(source, packages)}
    return edges


def circle(edges: dict[str, set[str]]) -> list[str]:
    """One circle of ``edges`` (its first name again at its end), or ``[]`` when there is none."""
    try:
        graphlib.TopologicalSorter(edges).prepare()
    except graphlib.CycleError as exc:
        return list(exc.args[1])
    return []


def test_no_circle_between_bench_modules() -> None:
    assert circle(module_graph()) == []


def test_no_circle_between_bench_packages() -> None:
    assert circle(package_graph()) == []


def test_a_package_init_imports_nothing_of_bench() -> None:
    modules = module_names(BENCH)
    offenders = {
        name: sorted(imported(path, name, set(modules)))
        for name, path in modules.items()
        if path.name == "__init__.py" and imported(path, name, set(modules))
    }
    assert offenders == {}


TOP_LEVEL = {"bench", "bench.__main__", "bench.cli"}
SHARED = {"bench.harness", "bench.servers"}


def test_every_bench_module_is_in_a_package_by_workload() -> None:
    top = {name for name, path in module_names(BENCH).items() if path.parent == BENCH}
    assert top == TOP_LEVEL


def test_every_folder_of_python_is_a_package() -> None:
    # A folder without ``__init__.py`` would be read as modules of no package, its circles unseen.
    folders = {path.parent for path in BENCH.rglob("*.py") if "__pycache__" not in path.parts}
    assert sorted(str(f.relative_to(BENCH)) for f in folders if not (f / "__init__.py").is_file()) == []


def test_the_shared_parts_import_no_workload() -> None:
    edges = package_graph()
    assert {name: sorted(edges[name] - SHARED) for name in SHARED if edges[name] - SHARED} == {}


def test_the_layout_has_the_workloads_it_describes() -> None:
    packages = {name for name in package_graph() if name not in TOP_LEVEL}
    assert {
        "bench.paths",
        "bench.streams",
        "bench.releases",
        "bench.storm",
        "bench.table",
    } | SHARED <= packages


# --- the check finds what it is for ------------------------------------------------------------


def write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root / "bench"


def test_control_a_type_only_import_back_is_a_circle(tmp_path: Path) -> None:
    # The shape of the streams workload's report and its side-by-side reading before they were split:
    # the report imports the reading's functions, the reading names the report's type for mypy.
    bench = write(tmp_path, {
        "bench/__init__.py": "",
        "bench/streams_report.py": "from bench.streams_versus import versus_lines\nclass PathRun: ...\n",
        "bench/streams_versus.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                   "    from bench.streams_report import PathRun\ndef versus_lines(): ...\n",
    })  # fmt: skip
    found = circle(module_graph(bench))
    assert set(found) == {"bench.streams_report", "bench.streams_versus"}


def test_control_a_lazy_import_back_is_a_circle(tmp_path: Path) -> None:
    bench = write(tmp_path, {
        "bench/__init__.py": "",
        "bench/cli.py": "def main():\n    from bench import run\n",
        "bench/run.py": "from bench.cli import main\n",
    })  # fmt: skip
    assert set(circle(module_graph(bench))) == {"bench.cli", "bench.run"}


def test_control_packages_in_a_circle_through_different_modules(tmp_path: Path) -> None:
    bench = write(tmp_path, {
        "bench/__init__.py": "",
        "bench/storm/__init__.py": "",
        "bench/storm/run.py": "from bench.releases.launch import launched\n",
        "bench/releases/__init__.py": "",
        "bench/releases/launch.py": "launched = 1\n",
        "bench/releases/run.py": "from ..storm import run\n",
    })  # fmt: skip
    assert circle(module_graph(bench)) == []
    assert set(circle(package_graph(bench))) == {"bench.storm", "bench.releases"}
