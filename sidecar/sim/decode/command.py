"""``kv-release-sidecar sim-decode``: serve the fake vLLM decode server until interrupted."""

from __future__ import annotations

import argparse
import importlib.util
import sys

from sidecar.config import ConfigError
from sidecar.sim.decode.app import DecodeHooks, create_decode_app
from sidecar.sim.decode.config import add_arguments, config_from_args

__all__ = ["add_arguments", "run"]


def run(args: argparse.Namespace) -> int:
    """Serve the simulator until interrupted; 2 on a bad flag value."""
    import uvicorn

    try:
        config = config_from_args(args)
    except ConfigError as exc:
        print(f"sim-decode: {exc}", file=sys.stderr)
        return 2
    hooks: DecodeHooks | None = None
    if config.vllm_d:
        from sidecar.sim.decode.nixl import VllmDHooks

        hooks = VllmDHooks(config.version)
    uvicorn.run(
        create_decode_app(config, hooks),
        host=config.host,
        port=config.port,
        loop="uvloop" if _importable("uvloop") else "asyncio",
        http="httptools" if _importable("httptools") else "h11",
        log_level="warning",
        access_log=False,
    )
    return 0


def _importable(name: str) -> bool:
    return importlib.util.find_spec(name) is not None
