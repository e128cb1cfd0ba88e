"""The install recipes, offline: the core and extras as documented, the NIXL pins equal to uv.lock.

``requirements/nixl.txt`` is installed with ``--no-deps``, so its pins must
be exact and the ones uv.lock resolved; ``test_resolution.py`` checks online
that they resolve without torch.
"""

from __future__ import annotations

import tomllib

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from sidecar import extras
from tests.packaging.recipes import CORE, NIXL_RECIPE, PYPROJECT, ROOT, forbidden


def _locked() -> dict[str, set[str]]:
    lock = tomllib.loads((ROOT / "uv.lock").read_text())
    versions: dict[str, set[str]] = {}
    for package in lock["package"]:
        versions.setdefault(canonicalize_name(package["name"]), set()).add(package["version"])
    return versions


def _recipe() -> list[Requirement]:
    lines = [line.split("#")[0].strip() for line in NIXL_RECIPE.read_text().splitlines()]
    return [Requirement(line) for line in lines if line]


def test_nixl_recipe_pins_the_locked_versions_of_the_nixl_extra() -> None:
    locked = _locked()
    recipe = _recipe()
    for requirement in recipe:
        (spec,) = requirement.specifier
        assert spec.operator == "==", f"{requirement}: pin an exact version (installed with --no-deps)"
        assert spec.version in locked[canonicalize_name(requirement.name)], f"{requirement} is not in uv.lock"
    extra = {
        canonicalize_name(Requirement(r).name) for r in PYPROJECT["project"]["optional-dependencies"]["nixl"]
    }
    assert {canonicalize_name(r.name) for r in recipe} == extra
    environment = default_environment()
    pinned = [r for r in recipe if r.marker is None or r.marker.evaluate(environment)]
    assert sorted(canonicalize_name(r.name) for r in pinned) == sorted(extra), "one pin per package here"


def test_core_and_extras_are_as_documented() -> None:
    project = PYPROJECT["project"]
    assert {canonicalize_name(Requirement(r).name) for r in project["dependencies"]} == CORE
    assert (
        set(project["optional-dependencies"]) == {"nixl", "loadtest", "otel", "llm-d"} == set(extras.MODULES)
    )
    dev = PYPROJECT["dependency-groups"]["dev"]
    assert "kv-release-sidecar[nixl,loadtest,otel,llm-d]" in dev, "make demo and make test need every extra"
    assert not forbidden(_locked()), "uv.lock holds torch, triton or nvidia-*"
