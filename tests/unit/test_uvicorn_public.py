"""No module of ``sidecar/`` reaches a private name of uvicorn: only its public surface is used.

The rule, checked on every module's syntax tree:

* uvicorn's public surface is what its package exports (``uvicorn.__all__``:
  ``Config``, ``Server``, ``run``, ``main``). ``import uvicorn`` and
  ``from uvicorn import <one of those>`` are the only imports of it; any
  ``uvicorn.<submodule>`` import (``uvicorn.protocols...``, ``uvicorn.server``,
  ``uvicorn._types``), and any ``uvicorn.<name>`` outside the surface, is refused.
* No name beginning with ``_`` (dunders aside) is reached through uvicorn: not
  as an attribute of the module or of its classes, not on an object made from
  them (a name assigned a ``Config(...)``/``Server(...)`` or annotated as one),
  not by ``getattr``/``setattr``/``hasattr``/``delattr`` with such a name in a
  module that uses uvicorn.
* A class of the sidecar's that subclasses a uvicorn class holds no ``_``
  name at all, neither reading nor writing ``self._x`` nor defining ``_x``:
  in such a class a reader cannot tell the sidecar's private names from
  uvicorn's. Its subclasses elsewhere in ``sidecar/`` count as uvicorn's
  classes for the two rules above.

What the sidecar does rely on of the public surface (``Server.startup``, its
``server_state``, ...) is checked against the installed release by
``tests/unit/test_uvicorn_contract.py``.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest
import uvicorn

ROOT = Path(__file__).resolve().parents[2]
PUBLIC = frozenset(uvicorn.__all__)
REFLECTION = frozenset({"getattr", "setattr", "hasattr", "delattr"})


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


@dataclass(frozen=True)
class Finding:
    line: int
    what: str


class Scan:
    """What one module reaches of uvicorn; ``derived`` are the names of the sidecar's own subclasses
    of uvicorn classes (they count as uvicorn's)."""

    def __init__(self, tree: ast.AST, derived: frozenset[str] = frozenset()) -> None:
        self.nodes = list(ast.walk(tree))
        self.derived = derived
        self.modules: set[str] = set()  # local names of the uvicorn module
        self.classes: set[str] = set(derived)  # local names of uvicorn's classes (and their subclasses)
        self.objects: set[str] = set()  # local names of objects made from them
        self.findings: list[Finding] = []
        self.subclasses: set[str] = set()  # classes defined here that subclass a uvicorn class

    def run(self) -> list[Finding]:
        self._imports()
        self._classes()
        self._objects()
        uses = self._uses_uvicorn()
        for node in self.nodes:
            if isinstance(node, ast.Attribute):
                self._attribute(node)
            elif isinstance(node, ast.Call) and uses:
                self._reflection(node)
        return sorted(set(self.findings), key=lambda f: (f.line, f.what))

    def _note(self, node: ast.AST, what: str) -> None:
        self.findings.append(Finding(getattr(node, "lineno", 0), what))

    def _uses_uvicorn(self) -> bool:
        named = {node.id for node in self.nodes if isinstance(node, ast.Name)}
        return bool(self.modules or (self.classes - self.derived) or named & self.derived)

    def subclasses_of(self) -> set[str]:
        """The classes this module defines on a uvicorn class."""
        self._imports()
        self._classes()
        return self.subclasses

    def _imports(self) -> None:
        for node in self.nodes:
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name == "uvicorn":
                        self.modules.add(alias.asname or "uvicorn")
                    elif alias.name.startswith("uvicorn."):
                        self._note(node, f"import {alias.name}: not uvicorn's public surface")
            elif isinstance(node, ast.ImportFrom) and node.module:
                if node.module.startswith("uvicorn."):
                    self._note(node, f"from {node.module} import ...: not uvicorn's public surface")
                elif node.module == "uvicorn":
                    for alias in node.names:
                        if alias.name in PUBLIC:
                            self.classes.add(alias.asname or alias.name)
                        else:
                            self._note(node, f"from uvicorn import {alias.name}: not in uvicorn.__all__")

    def _is_uvicorn(self, node: ast.AST) -> bool:
        """``node`` names uvicorn, one of its classes, or an object made from them."""
        while isinstance(node, ast.Attribute | ast.Call | ast.Subscript):
            node = node.func if isinstance(node, ast.Call) else node.value
        return isinstance(node, ast.Name) and node.id in (self.modules | self.classes | self.objects)

    def _classes(self) -> None:
        for node in self.nodes:
            if isinstance(node, ast.ClassDef) and any(self._is_uvicorn(base) for base in node.bases):
                self.subclasses.add(node.name)
                self.classes.add(node.name)
                self._subclass(node)

    def _subclass(self, cls: ast.ClassDef) -> None:
        for node in ast.walk(cls):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and _private(node.name):
                self._note(node, f"{cls.name}.{node.name}: a _ name defined on a subclass of a uvicorn class")
            elif isinstance(node, ast.Attribute) and _private(node.attr):
                owner = node.value
                is_self = isinstance(owner, ast.Name) and owner.id in ("self", "cls")
                is_super = isinstance(owner, ast.Call) and getattr(owner.func, "id", "") == "super"
                if is_self or is_super:
                    self._note(node, f"{cls.name}: self.{node.attr} on a subclass of a uvicorn class")

    def _objects(self) -> None:
        for node in self.nodes:
            if isinstance(node, ast.Assign) and self._is_uvicorn(node.value):
                self.objects.update(t.id for t in node.targets if isinstance(t, ast.Name))
            elif isinstance(node, ast.AnnAssign | ast.arg):
                annotation = node.annotation
                target = node.target if isinstance(node, ast.AnnAssign) else node
                name = target.id if isinstance(target, ast.Name) else getattr(target, "arg", "")
                if annotation is not None and name and self._is_uvicorn(annotation):
                    self.objects.add(name)

    def _attribute(self, node: ast.Attribute) -> None:
        value = node.value
        if isinstance(value, ast.Name) and value.id in self.modules and node.attr not in PUBLIC:
            self._note(node, f"uvicorn.{node.attr}: not in uvicorn.__all__")
        elif _private(node.attr) and self._is_uvicorn(value):
            self._note(node, f".{node.attr} reached through uvicorn")

    def _reflection(self, node: ast.Call) -> None:
        name = getattr(node.func, "id", "")
        literal = node.args[1] if name in REFLECTION and len(node.args) > 1 else None
        if isinstance(literal, ast.Constant) and isinstance(literal.value, str) and _private(literal.value):
            self._note(node, f"{name}(..., {literal.value!r}) in a module that uses uvicorn")


def scan(sources: dict[str, str]) -> dict[str, list[Finding]]:
    """Every module's findings, its subclasses of uvicorn classes known to the others."""
    trees = {path: ast.parse(text) for path, text in sources.items()}
    derived = frozenset(name for tree in trees.values() for name in Scan(tree).subclasses_of())
    found = {path: Scan(tree, derived).run() for path, tree in trees.items()}
    return {path: findings for path, findings in found.items() if findings}


def sidecar_sources() -> dict[str, str]:
    return {str(p.relative_to(ROOT)): p.read_text() for p in sorted((ROOT / "sidecar").rglob("*.py"))}


def test_no_module_of_the_sidecar_reaches_a_private_name_of_uvicorn() -> None:
    sources = sidecar_sources()
    assert scan(sources) == {}
    # the scan sees what it judges: the sidecar's uvicorn server and the simulators that run uvicorn
    trees = {path: Scan(ast.parse(text)) for path, text in sources.items()}
    for scanned in trees.values():
        scanned.run()
    assert trees["sidecar/server/host.py"].subclasses == {"Server"}
    assert {p for p, s in trees.items() if s.modules} >= {
        "sidecar/server/host.py",
        "sidecar/sim/servers.py",
    }


PRIVATE_USES = {
    "from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, STATUS_LINE": [
        "from uvicorn.protocols.http.httptools_impl import ...: not uvicorn's public surface"
    ],
    "import uvicorn.server": ["import uvicorn.server: not uvicorn's public surface"],
    "from uvicorn import _types": ["from uvicorn import _types: not in uvicorn.__all__"],
    "import uvicorn\nstate = uvicorn.server.ServerState()": ["uvicorn.server: not in uvicorn.__all__"],
    "import uvicorn\nuvicorn.Server._serve": ["._serve reached through uvicorn"],
    "import uvicorn as u\ns = u.Server(u.Config(app))\ns._captured_signals.clear()": [
        "._captured_signals reached through uvicorn"
    ],
    "from uvicorn import Config\ndef f(c: Config):\n    return c._loaded": [
        "._loaded reached through uvicorn"
    ],
    "import uvicorn\nclass S(uvicorn.Server):\n    def startup(self):\n        self._captured_signals = []": [
        "S: self._captured_signals on a subclass of a uvicorn class"
    ],
    "import uvicorn\nclass S(uvicorn.Server):\n    async def _serve(self):\n        await super()._serve()": [
        "S._serve: a _ name defined on a subclass of a uvicorn class",
        "S: self._serve on a subclass of a uvicorn class",
    ],
    "import uvicorn\ndef f(s):\n    return getattr(s, '_serve')": [
        "getattr(..., '_serve') in a module that uses uvicorn"
    ],
}


@pytest.mark.parametrize("source", list(PRIVATE_USES), ids=range(len(PRIVATE_USES)))
def test_each_way_of_reaching_a_private_name_is_refused(source: str) -> None:
    found = scan({"m.py": source}).get("m.py", [])
    assert [f.what for f in found] == PRIVATE_USES[source]


def test_a_subclass_elsewhere_counts_as_uvicorns_and_public_uses_pass() -> None:
    host = "import uvicorn\nclass Server(uvicorn.Server):\n    startup_failed = False\n"
    user = "from host import Server\nserver = Server(config)\nserver.should_exit = True\nserver._serve()\n"
    assert scan({"host.py": host, "user.py": user}) == {
        "user.py": [Finding(4, "._serve reached through uvicorn")]
    }
    public = (
        "import uvicorn\nfrom uvicorn import Config, Server\n"
        "server = uvicorn.Server(Config(app, http='httptools'))\nserver.should_exit = True\n"
        "class Mine:\n    def __init__(self):\n        self._servers: list[uvicorn.Server] = []\n"
    )
    assert scan({"public.py": public}) == {}
