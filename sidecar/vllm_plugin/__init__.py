"""A vLLM plugin for the decode server D: ``POST /kv_release/v1/release`` frees P's KV blocks.

The sidecar's ``http`` strategy asks D to do what vLLM's own fix does for a
request D rejected before admission (``notify_kv_transfer_request_rejected``,
0.21.0+; emulated with a one-token request aborted at once on older releases),
so D's NIXL connector notifies P. Two ways in, both official vLLM extension
points: ``KVReleasePlugin`` (endpoint plugin ``kv_release``, vLLM 0.26.0+,
enabled by ``VLLM_PLUGINS=kv_release``) and ``KVReleaseMiddleware`` (any
release: ``--middleware sidecar.vllm_plugin.KVReleaseMiddleware``). Both serve
the same routes through one ``ControlService`` per app.

Loaded inside vLLM's API server: it imports starlette, msgspec and
``sidecar.wire`` only (no ZMQ, HTTP client, NIXL or sidecar server module),
imports vLLM lazily, and keeps no module-level mutable state, so importing it
twice, or enabling both forms, is harmless.
"""

from __future__ import annotations

from sidecar.vllm_plugin.endpoint import KVReleasePlugin
from sidecar.vllm_plugin.messages import HEALTH_PATH, RELEASE_PATH
from sidecar.vllm_plugin.middleware import KVReleaseMiddleware
from sidecar.vllm_plugin.settings import PluginSettings

__all__ = ["HEALTH_PATH", "RELEASE_PATH", "KVReleaseMiddleware", "KVReleasePlugin", "PluginSettings"]
