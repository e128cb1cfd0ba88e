"""``kv-release-sidecar sim-prefill``: a vLLM prefill node (P) with a real NIXL side."""

from __future__ import annotations

from sidecar.sim.prefill.app import (
    PrefillSimConfig,
    create_prefill_app,
)

__all__ = [
    "PrefillSimConfig",
    "create_prefill_app",
]
