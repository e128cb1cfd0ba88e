"""What the install recipes are: the core, the extras, the NIXL recipes, and what must never enter."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
NIXL_RECIPE = ROOT / "requirements" / "nixl.txt"
NO_TORCH = ROOT / "requirements" / "no-torch.txt"
FORBIDDEN = re.compile(r"^(torch|triton|nvidia-.*)$")
CORE = {"starlette", "uvicorn", "uvloop", "httptools", "httpx", "msgspec", "prometheus-client", "cachetools"}
OPTIONAL = {"nixl-cu12", "numpy", "pyzmq", "aiohttp", "matplotlib", "opentelemetry-sdk"}


def forbidden(names: set[str] | dict[str, Any]) -> list[str]:
    return sorted(name for name in names if FORBIDDEN.match(name))
