"""The fake vLLM decode server D (``kv-release-sidecar sim-decode``)."""

from __future__ import annotations

from sidecar.sim.decode.app import (
    DecodeSimConfig,
    SimulatedDrop,
    add_arguments,
    create_decode_app,
)

__all__ = [
    "DecodeSimConfig",
    "SimulatedDrop",
    "add_arguments",
    "create_decode_app",
]
