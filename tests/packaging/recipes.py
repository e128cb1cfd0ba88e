"""What the install recipes are: the core, the extras, the NIXL recipes, and what must never enter."""

from __future__ import annotations

import re
import shutil
import tomllib
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
NIXL_RECIPE = ROOT / "requirements" / "nixl.txt"
NO_TORCH = ROOT / "requirements" / "no-torch.txt"
FORBIDDEN = re.compile(r"^(torch|triton|nvidia-.*)$")
CORE = {"starlette", "uvicorn", "uvloop", "httptools", "httpx", "msgspec", "prometheus-client", "cachetools"}
OPTIONAL = {"nixl-cu12", "numpy", "pyzmq", "aiohttp", "matplotlib", "opentelemetry-sdk"}


def forbidden(names: set[str] | dict[str, Any]) -> list[str]:
    return sorted(name for name in names if FORBIDDEN.match(name))


# The platforms the project supports, as markers see them and as wheels are tagged (manylinux_2_28:
# nixl-cu12's tag; glibc 2.28 or newer: Debian 10+, RHEL 8+, Ubuntu 18.10+).
PLATFORMS = {
    "x86_64": "manylinux_2_28_x86_64",
    "aarch64": "manylinux_2_28_aarch64",
}


def environment(machine: str, python: str) -> dict[str, str]:
    """Marker variables of CPython ``python`` on Linux ``machine``."""
    return {
        "implementation_name": "cpython",
        "implementation_version": f"{python}.0",
        "os_name": "posix",
        "platform_machine": machine,
        "platform_python_implementation": "CPython",
        "platform_release": "",
        "platform_system": "Linux",
        "platform_version": "",
        "python_full_version": f"{python}.0",
        "python_version": python,
        "sys_platform": "linux",
        "extra": "",
    }


def uv_binary() -> str:
    found = shutil.which("uv", path=str(ROOT / ".tools" / "bin")) or shutil.which("uv")
    if not found:
        pytest.skip("no uv found (make installs one in .tools/): the uv recipe is not checked")
    return found
