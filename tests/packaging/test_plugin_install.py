"""The vLLM plugin, installed into D's environment as the docs say, changes no package vLLM resolved.

docs/control-endpoint.md and ``deploy/vllm-plugin.Dockerfile`` install this
checkout's wheel into vLLM's image with ``pip install --no-deps``. Here D's
environment is a virtualenv holding the real vLLM of that Dockerfile (its
wheel, from the conformance cache, installed with ``--no-deps``: its torch and
CUDA stack would be gigabytes) and, resolved by pip from the package index,
what vLLM's own metadata requires of the packages the plugin imports
(``fastapi[standard]``, ``starlette``, ``msgspec`` at vLLM's specifiers: the
FastAPI, Starlette and uvicorn vLLM serves with). Then the wheel goes in as the
docs say, and every distribution ``pip list`` names keeps its version, the
plugin's own the only one added; vLLM finds the plugin by its entry point and it loads
there. The control: a plain ``pip install`` of the same wheel would have
added or moved packages in that environment. Without a package index the
module skips with one line.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.conformance.wheels import fetch_wheel
from tests.packaging.recipes import ROOT
from tests.support.index import unreachable

if reason := unreachable():
    pytest.skip(
        f"{reason}: the plugin's install into vLLM's environment not checked", allow_module_level=True
    )

DOCKERFILE = ROOT / "deploy" / "vllm-plugin.Dockerfile"
PLUGIN_IMPORTS = {"fastapi", "starlette", "msgspec"}  # what vLLM's requirements give the plugin


def vllm_release() -> str:
    """The vLLM release the plugin's image is built on (its ``FROM`` line)."""
    match = re.search(r"^FROM vllm/vllm-openai:v(\S+)$", DOCKERFILE.read_text(), re.MULTILINE)
    assert match, "deploy/vllm-plugin.Dockerfile names no vllm/vllm-openai release"
    return match[1]


def vllm_requirements(wheel: Path) -> list[str]:
    """vLLM's own requirements on the packages the plugin imports, as its metadata states them."""
    with zipfile.ZipFile(wheel) as whole:
        name = next(n for n in whole.namelist() if n.endswith(".dist-info/METADATA"))
        lines = whole.read(name).decode().splitlines()
    found = [line.removeprefix("Requires-Dist: ") for line in lines if line.startswith("Requires-Dist: ")]
    chosen = [r for r in found if canonicalize_name(Requirement(r).name) in PLUGIN_IMPORTS]
    return [r for r in chosen if Requirement(r).marker is None or Requirement(r).marker.evaluate()]  # type: ignore[union-attr]


def run(*command: str | Path, timeout: float = 900) -> str:
    done = subprocess.run(
        [str(c) for c in command], capture_output=True, text=True, timeout=timeout, check=False
    )
    assert done.returncode == 0, f"{command}: {done.stderr[-3000:]}"
    return done.stdout


@pytest.fixture(scope="module")
def plugin_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("plugin-wheel")
    run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", out, ROOT, timeout=300)
    (built,) = out.glob("kv_release_sidecar-*.whl")
    return built


@pytest.fixture(scope="module")
def d_environment(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """D's environment, with pip in it: vLLM (no dependencies) and what pip resolves of vLLM's
    requirements on the plugin's imports. uv makes it (a vLLM wheel is 240 MB: pip's install of it
    takes minutes on a busy machine); the plugin then goes in with D's own pip, as the docs say."""
    uv = shutil.which("uv", path=str(ROOT / ".tools" / "bin")) or shutil.which("uv")
    if uv is None:
        pytest.fail("no uv: run make (it installs one in .tools/)")
    venv = tmp_path_factory.mktemp("d") / "venv"
    run(uv, "venv", "--quiet", "--seed", "--python", sys.executable, venv, timeout=300)
    python = venv / "bin" / "python"
    wheel = fetch_wheel(vllm_release())
    run(uv, "pip", "install", "--quiet", "--python", python, "--no-deps", wheel)
    run(python, "-m", "pip", "install", "--quiet", *vllm_requirements(wheel))
    return python


def installed(python: Path) -> dict[str, str]:
    """Every distribution in the environment and its version (``pip list``, as ``pip freeze`` lists them)."""
    listed = json.loads(run(python, "-m", "pip", "list", "--format", "json"))
    return {canonicalize_name(item["name"]): item["version"] for item in listed}


@pytest.mark.timeout(900)
def test_installing_the_plugin_as_the_docs_say_changes_no_package_of_vllms(
    d_environment: Path, plugin_wheel: Path, tmp_path: Path
) -> None:
    python = d_environment
    command = re.search(r"pip install (--no-cache-dir --no-deps) /tmp/", DOCKERFILE.read_text())
    assert command, "the Dockerfile's pip command changed: update this test with it"
    before = installed(python)
    assert before["vllm"] == vllm_release() and before.keys() >= PLUGIN_IMPORTS | {"uvicorn"}
    # the control: without --no-deps, pip would change vLLM's environment
    report = tmp_path / "report.json"
    run(python, "-m", "pip", "install", "--dry-run", "--quiet", "--report", report, plugin_wheel)
    would = {
        canonicalize_name(item["metadata"]["name"]) for item in json.loads(report.read_text())["install"]
    }
    assert would - {"kv-release-sidecar"}, (
        "a plain install would change nothing: the check below proves nothing"
    )
    run(python, "-m", "pip", "install", *command[1].split(), plugin_wheel)
    after = installed(python)
    assert {name: after.get(name) for name in before} == before  # nothing removed or moved
    assert sorted(after.keys() - before.keys()) == ["kv-release-sidecar"]


@pytest.mark.timeout(900)
def test_vllm_finds_the_plugin_by_its_entry_point_and_it_loads_there(
    d_environment: Path, plugin_wheel: Path
) -> None:
    run(d_environment, "-m", "pip", "install", "--quiet", "--no-deps", plugin_wheel)
    script = (
        "from importlib.metadata import entry_points\n"
        "(plugin,) = entry_points(group='vllm.endpoint_plugins', name='kv_release')\n"
        "cls = plugin.load()\n"
        "from sidecar.vllm_plugin import KVReleaseMiddleware\n"
        "import sys\n"
        "print(cls.__name__, KVReleaseMiddleware.__name__, 'httpx' in sys.modules, 'uvloop' in sys.modules)\n"
    )
    # the sidecar's own server dependencies (httpx, uvloop, prometheus-client...) are not needed
    assert run(d_environment, "-c", script).split() == [
        "KVReleasePlugin",
        "KVReleaseMiddleware",
        "False",
        "False",
    ]
