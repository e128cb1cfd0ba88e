"""Every bench the docs, the Makefile, the CI script and the manifests name is there to run.

A reader copies ``python -m bench.storm --quick`` or opens ``bench/streams/streams.c``
from a page; when a module moves, the page must move with it. Three kinds of mention
are checked against the tree:

- a command, ``python -m bench...``: a module, or a package with a ``__main__``;
- a path, ``bench/...``: a file or folder of the checkout;
- a dotted name in backticks, ``bench.releases.metrics`` or ``bench.streams.run.settings``:
  a module or package, or a name its module defines at the top.

``CHANGELOG.md`` is left out: it records what the tree was when each entry was written.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TREES = ("docs", "deploy", ".ci")
FILES = ("README.md", "Makefile")
SKIPPED_SUFFIXES = {".json", ".png", ".svg", ".lock"}

COMMAND = re.compile(r"\bpython3? -m\s+(bench(?:\.\w+)*)")
PATH = re.compile(r"(?<![\w./-])(bench/[\w./-]*\w)")
DOTTED = re.compile(r"`(bench(?:\.\w+)+)")
DATA_SUFFIXES = {"json", "md", "txt", "csv", "html", "log", "svg"}  # ``bench.json``: a file, not a module


def documents(root: Path = ROOT) -> list[Path]:
    """The files that name benches for a reader: the docs, the Makefile, the CI script, the manifests."""
    found = [root / name for name in FILES if (root / name).is_file()]
    for tree in TREES:
        found += [
            path
            for path in sorted((root / tree).rglob("*"))
            if path.is_file() and path.suffix not in SKIPPED_SUFFIXES
        ]
    return found


def _module(root: Path, dotted: str) -> Path | None:
    """The file of module or package ``dotted`` below ``root``, or None."""
    base = root.joinpath(*dotted.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _defines(module: Path, name: str) -> bool:
    """Whether ``module`` binds ``name`` at its top: a function, a class, an assignment or an import."""
    bound: set[str] = set()
    for node in ast.parse(module.read_text()).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            bound.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            bound |= {t.id for t in targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.ImportFrom | ast.Import):
            bound |= {a.asname or a.name.split(".")[0] for a in node.names}
    return name in bound


def runnable(root: Path, dotted: str) -> bool:
    """``python -m dotted`` finds something to run in ``root``: a module, or a package's ``__main__``."""
    module = _module(root, dotted)
    return module is not None and (module.name != "__init__.py" or (module.parent / "__main__.py").is_file())


def named(root: Path, dotted: str) -> bool:
    """``dotted`` is a module or package of ``root``, or a top-level name of one."""
    if dotted.rsplit(".", 1)[-1] in DATA_SUFFIXES or _module(root, dotted) is not None:
        return True
    parent, _, name = dotted.rpartition(".")
    module = _module(root, parent)
    return module is not None and _defines(module, name)


def stale(root: Path, files: list[Path]) -> list[str]:
    """Each mention in ``files`` that names no bench of ``root``, as ``file: mention``."""
    found = []
    for path in files:
        text = path.read_text(errors="replace")
        where = path.relative_to(root)
        found += [f"{where}: python -m {m}" for m in COMMAND.findall(text) if not runnable(root, m)]
        found += [f"{where}: {p}" for p in PATH.findall(text) if not (root / p).exists()]
        found += [f"{where}: {d}" for d in DOTTED.findall(text) if not named(root, d)]
    return sorted(set(found))


def test_every_bench_the_docs_name_is_there() -> None:
    assert stale(ROOT, documents()) == []


def test_the_scan_reads_the_docs_and_the_makefile() -> None:
    scanned = {str(path.relative_to(ROOT)) for path in documents()}
    assert {"Makefile", "README.md", "docs/performance.md", ".ci/run"} <= scanned
    assert "CHANGELOG.md" not in scanned
    mentions = sum(len(COMMAND.findall(path.read_text(errors="replace"))) for path in documents())
    assert mentions >= 8  # make bench alone runs seven benches


# --- the check finds what it is for ------------------------------------------------------------


def tree(root: Path) -> Path:
    for name, text in {
        "bench/__init__.py": "",
        "bench/__main__.py": "",
        "bench/cli.py": "",
        "bench/storm/__init__.py": "",
        "bench/storm/__main__.py": "",
        "bench/storm/run.py": "def main() -> int: ...\nQUICK = 1\n",
        "bench/streams/__init__.py": "",
        "bench/streams/streams.c": "",
    }.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def mentions(root: Path, text: str) -> list[str]:
    (root / "docs").mkdir(exist_ok=True)
    (root / "docs" / "page.md").write_text(text)
    return stale(root, documents(root))


def test_control_what_is_there_passes(tmp_path: Path) -> None:
    text = (
        "Run `python -m bench`, `python -m bench.storm --quick` or python -m bench.storm.run;\n"
        "the C client is `bench/streams/streams.c`, the knobs `bench.storm.run.QUICK`,\n"
        "the servers in `bench.storm`, the figures in `out/bench.json` and `bench.json`.\n"
    )
    assert mentions(tree(tmp_path), text) == []


def test_control_a_moved_module_is_found(tmp_path: Path) -> None:
    text = "Run `python -m bench.bench_storm --quick` (its worker is `bench.storm_worker`).\n"
    assert mentions(tree(tmp_path), text) == [
        "docs/page.md: bench.storm_worker",
        "docs/page.md: python -m bench.bench_storm",
    ]


def test_control_a_command_split_over_two_lines_is_read(tmp_path: Path) -> None:
    assert mentions(tree(tmp_path), "Then `python -m\nbench.bench_tracing` measures it.\n") == [
        "docs/page.md: python -m bench.bench_tracing"
    ]


def test_control_a_package_without_main_does_not_run(tmp_path: Path) -> None:
    assert mentions(tree(tmp_path), "python -m bench.streams\n") == ["docs/page.md: python -m bench.streams"]


def test_control_a_moved_file_and_a_missing_name_are_found(tmp_path: Path) -> None:
    text = "See bench/streams.c and `bench.storm.run.FULL`.\n"
    assert mentions(tree(tmp_path), text) == [
        "docs/page.md: bench.storm.run.FULL",
        "docs/page.md: bench/streams.c",
    ]


def test_control_the_makefile_is_read(tmp_path: Path) -> None:
    root = tree(tmp_path)
    (root / "Makefile").write_text("bench:\n\t$(UV) run python -m bench.bench_router\n")
    assert stale(root, documents(root)) == ["Makefile: python -m bench.bench_router"]
