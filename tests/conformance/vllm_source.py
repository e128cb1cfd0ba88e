"""vLLM's source as data for conformance tests: read out of a downloaded wheel, never imported.

The wheel comes from the cache ``test_vllm_p_side.py`` fills (``pip download
--no-deps``, ``$KVR_VLLM_WHEEL_DIR`` or ``~/.cache/kv-release-sidecar/vllm``);
nothing of vLLM is vendored. ``Source`` parses the chosen files with ``ast``
and answers the questions the coverage tests ask: where a function is, what
it calls, what it can reach by name, and which OpenAI error answers it builds.
Reachability goes by name over the chosen files, so it over-approximates; the
tests use it both ways (this site is reachable from that handler, that one
is not).
"""

from __future__ import annotations

import ast
import os
import zipfile
from collections import defaultdict
from pathlib import Path

from sidecar.nixl.versions import WireProfile, parse_version
from tests.conformance.wheels import fetch_wheel

Func = ast.FunctionDef | ast.AsyncFunctionDef
FUNCS = (ast.FunctionDef, ast.AsyncFunctionDef)
# Functions that build vLLM's OpenAI error answer (defaults: "BadRequestError", 400).
ANSWER_BUILDERS = frozenset({"create_error_response", "create_streaming_error_response"})


def wheel_or_skip(version: str) -> Path:
    """The cached wheel, downloaded if needed; a skip (one line) when no index can be reached."""
    return fetch_wheel(version)


def releases(variable: str, default: str = "0.21.0,0.25.1,0.29.0,0.31.0,0.33.0,0.34.0") -> list[str]:
    """The vLLM releases a test module reads: ``$variable`` (comma-separated) or ``default``."""
    return [v for v in os.environ.get(variable, default).split(",") if v]


#: The known release whose wire format the sidecar speaks to P of a release it does not know. The
#: release-day lane (``tests/conformance/release_day.py``) sets it to the newest known release, to
#: learn whether that format still works; unset, such a release fails the NIXL tests, as the
#: sidecar itself refuses to release to a release it does not know.
WIRE_AS = "KVR_CONFORMANCE_WIRE_AS"


def spoken(version: str) -> str:
    """The release whose wire format the sidecar speaks to P of ``version``."""
    if WireProfile.for_version(version) is not None:
        return version
    return os.environ.get(WIRE_AS) or version


def release_source(version: str, prefixes: tuple[str, ...]) -> tuple[tuple[int, int, int], Source]:
    """(release, ``Source`` of its wheel's files under ``prefixes``) for a module fixture."""
    parsed = parse_version(version)
    assert parsed is not None, version
    return parsed.release, Source(wheel_or_skip(version), prefixes)


class Source:
    """The ``.py`` files of a wheel under ``prefixes``, parsed, with every def indexed by name."""

    def __init__(self, wheel: Path, prefixes: tuple[str, ...]) -> None:
        with zipfile.ZipFile(wheel) as archive:
            self.files = {
                name: archive.read(name).decode()
                for name in archive.namelist()
                if name.endswith(".py") and name.startswith(prefixes)
            }
        self.trees = {name: ast.parse(text) for name, text in self.files.items()}
        self.defs: defaultdict[str, list[tuple[str, str | None, Func]]] = defaultdict(list)
        for path, tree in self.trees.items():
            for node in tree.body:
                if isinstance(node, FUNCS):
                    self.defs[node.name].append((path, None, node))
                elif isinstance(node, ast.ClassDef):
                    for item in node.body:
                        if isinstance(item, FUNCS):
                            self.defs[item.name].append((path, node.name, item))

    def find(self, name: str, path: str = "", cls: str | None = None) -> Func:
        """The one def named ``name`` in a file whose path contains ``path`` (in class ``cls``)."""
        found = [node for where, owner, node in self.defs[name] if path in where and cls in (None, owner)]
        assert len(found) == 1, f"{len(found)} defs of {name} in files matching {path!r}"
        return found[0]

    def has(self, name: str, path: str = "") -> bool:
        return any(path in where for where, _, _ in self.defs[name])

    def sites(self, predicate: str) -> list[tuple[str, str]]:
        """(path, def name) of every top-level def or method whose source contains ``predicate``."""
        return [
            (path, name)
            for name, entries in self.defs.items()
            for path, _, node in entries
            if predicate in ast.unparse(node)
        ]

    def reach(self, start: Func, within: tuple[str, ...]) -> dict[tuple[str, str], Func]:
        """Every def (path, name) in files under ``within`` that ``start`` may call, by name."""
        seen: dict[tuple[str, str], Func] = {}
        todo = [start]
        while todo:
            for name in calls(todo.pop()):
                for path, _, node in self.defs.get(name, []):
                    if path.startswith(within) and (path, name) not in seen:
                        seen[(path, name)] = node
                        todo.append(node)
        return seen

    def class_of(self, name: str, path: str) -> ast.ClassDef:
        found = [
            node
            for where, tree in self.trees.items()
            if path in where
            for node in tree.body
            if isinstance(node, ast.ClassDef) and node.name == name
        ]
        assert len(found) == 1, f"{len(found)} classes {name} in files matching {path!r}"
        return found[0]


def calls(node: ast.AST) -> set[str]:
    """Names of everything called in ``node``: ``f()``, ``self.f()``, ``x.y.f()`` all give ``f``."""
    names = set()
    for sub in ast.walk(node):
        if isinstance(sub, ast.Call):
            if isinstance(sub.func, ast.Name):
                names.add(sub.func.id)
            elif isinstance(sub.func, ast.Attribute):
                names.add(sub.func.attr)
    return names


def answers(node: ast.AST) -> set[tuple[str, str]]:
    """(type, HTTPStatus name) of every error answer ``node`` builds with a literal type, or with
    the default type for a literal message (an exception argument is mapped at run time)."""
    found = set()
    for sub in ast.walk(node):
        if not (isinstance(sub, ast.Call) and _name(sub.func) in ANSWER_BUILDERS):
            continue
        keywords = {k.arg: k.value for k in sub.keywords}
        type_node, status_node = keywords.get("err_type"), keywords.get("status_code")
        status = status_node.attr if isinstance(status_node, ast.Attribute) else "BAD_REQUEST"
        if isinstance(type_node, ast.Constant):
            found.add((str(type_node.value), status))
        elif type_node is None and sub.args and isinstance(sub.args[0], ast.Constant | ast.JoinedStr):
            found.add(("BadRequestError", status))
    return found


def raised(node: ast.AST) -> set[str]:
    """Names of the exceptions ``node`` raises by constructing them (``raise X(...)``)."""
    return {
        _name(sub.exc.func)
        for sub in ast.walk(node)
        if isinstance(sub, ast.Raise) and isinstance(sub.exc, ast.Call)
    }


def handlers(node: ast.AST) -> dict[str, ast.ExceptHandler]:
    """``except`` clauses in ``node`` by each exception name they catch."""
    found = {}
    for sub in ast.walk(node):
        if isinstance(sub, ast.ExceptHandler) and sub.type is not None:
            caught = sub.type.elts if isinstance(sub.type, ast.Tuple) else [sub.type]
            for name in caught:
                found[_name(name)] = sub
    return found


def first_line(node: Func, name: str) -> int:
    """The line of the first call of ``name`` in ``node`` (a large number when there is none)."""
    lines = [sub.lineno for sub in ast.walk(node) if isinstance(sub, ast.Call) and _name(sub.func) == name]
    return min(lines, default=1 << 30)


def _name(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return ""
