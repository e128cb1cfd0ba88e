"""The vLLM wheels the conformance tests read vLLM's own code from, cached across runs.

Each wheel is downloaded once (``pip download --no-deps vllm==X``, never
installed, never vendored; its x86_64 build on every machine, see
``WHEEL_PLATFORM``) into ``$KVR_VLLM_WHEEL_DIR`` or
``~/.cache/kv-release-sidecar/vllm``: ten releases, about 3.3 GB. A wheel
that is not cached while no package index answers skips its tests with one
line; a download that fails while the index answers fails them.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.support.index import unreachable

# The tests read a wheel's Python files only, which every platform's wheel of a release holds
# alike; some releases ship no aarch64 wheel (0.9.2, 0.11.0 and 0.21.0 among those tested), so an
# aarch64 machine downloads the x86_64 one too, the same file as here. pip names no "any glibc"
# platform: every manylinux tag vLLM's wheels carry, and the newer ones a release may.
WHEEL_PLATFORM = [
    *(
        option
        for tag in (
            "manylinux1",
            "manylinux2010",
            "manylinux2014",
            *(f"manylinux_2_{m}" for m in range(5, 46)),
        )
        for option in ("--platform", f"{tag}_x86_64")
    ),
    "--implementation",
    "cp",
    "--python-version",
    "3.11",
    "--only-binary=:all:",
]


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
    """The cached wheel of ``version``, downloading it first if needed; skips offline, raises on failure.

    Test processes running side by side (pytest-xdist's workers, or two checkouts sharing the cache)
    download a release once: the first takes a lock per release, the others wait for it, and the
    wheel enters the cache whole (downloaded beside it, then renamed).
    """
    if found := cached(version):
        return found
    skip_if_offline(version)
    directory = wheel_dir()
    directory.mkdir(parents=True, exist_ok=True)
    with (directory / f".vllm-{version}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if found := cached(version):
            return found
        with tempfile.TemporaryDirectory(dir=directory, prefix=".download-") as staging:
            return _download(version, Path(staging), directory)


def _download(version: str, staging: Path, directory: Path) -> Path:
    command = [*pip_command(), "download", "--no-deps", *WHEEL_PLATFORM, f"vllm=={version}"]
    command += ["-d", str(staging)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=900, check=False)
    found = sorted(staging.glob(f"vllm-{version}-*.whl"))
    if done.returncode != 0 or not found:
        raise RuntimeError(f"downloading vllm=={version} failed ({done.returncode}): {done.stderr[-2000:]}")
    return found[0].replace(directory / found[0].name)
