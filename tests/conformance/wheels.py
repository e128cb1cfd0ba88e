"""The vLLM wheels the conformance tests read vLLM's own code from, cached across runs.

Each wheel is downloaded once (``pip download --no-deps vllm==X``, never
installed, never vendored) into ``$KVR_VLLM_WHEEL_DIR`` or
``~/.cache/kv-release-sidecar/vllm``: ten releases, about 3.3 GB. A wheel
that is not cached while no package index answers skips its tests with one
line; a download that fails while the index answers fails them.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.index import unreachable


def wheel_dir() -> Path:
    default = Path.home() / ".cache" / "kv-release-sidecar" / "vllm"
    return Path(os.environ.get("KVR_VLLM_WHEEL_DIR", default))


def pip_command() -> list[str]:
    """A pip that can download: this interpreter's, the PATH's, or one run by uv."""
    probe = subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True, check=False)
    if probe.returncode == 0:
        return [sys.executable, "-m", "pip"]
    for name in ("pip3", "pip"):
        if path := shutil.which(name):
            return [path]
    if uvx := shutil.which("uvx"):
        return [uvx, "--from", "pip", "pip"]
    raise RuntimeError("no pip to download vLLM wheels with (install pip, or uv)")


def cached(version: str) -> Path | None:
    found = sorted(wheel_dir().glob(f"vllm-{version}-*.whl"))
    return found[0] if found else None


def skip_if_offline(version: str) -> None:
    """Skip when ``version`` is not cached and no index answers.

    Every such skip is raised here with the same text, so pytest's summary
    folds them into one line whatever the test and the release.
    """
    if cached(version) is None and (reason := unreachable()):
        pytest.skip(
            f"vLLM wheels not cached in {wheel_dir()} and {reason}: conformance with vLLM's code skipped"
        )


def fetch_wheel(version: str) -> Path:
    """The cached wheel of ``version``, downloading it first if needed; skips offline, raises on failure."""
    if found := cached(version):
        return found
    skip_if_offline(version)
    directory = wheel_dir()
    directory.mkdir(parents=True, exist_ok=True)
    command = [*pip_command(), "download", "--no-deps", "--only-binary=:all:", f"vllm=={version}"]
    command += ["-d", str(directory)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=900, check=False)
    found = sorted(directory.glob(f"vllm-{version}-*.whl"))
    if done.returncode != 0 or not found:
        raise RuntimeError(f"downloading vllm=={version} failed ({done.returncode}): {done.stderr[-2000:]}")
    return found[0]
