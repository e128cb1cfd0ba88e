"""The endpoint-plugin form, for vLLM 0.26.0+ (entry point group ``vllm.endpoint_plugins``).

vLLM discovers the entry point ``kv_release`` (``pyproject.toml``) but loads it
only when ``VLLM_PLUGINS`` names it; it calls the zero-argument factory (this
class), skips the plugin unless ``required_tasks`` meets the server's tasks,
calls ``attach_router(app)`` in ``build_app`` after the core routers, and
``await init_state(engine_client, app.state, args)`` at the end of
``init_app_state`` (``vllm/plugins/endpoint_plugins/interface.py``,
``vllm/plugins/__init__.py``). The routes are plain Starlette routes, so no
pydantic model or OpenAPI entry is involved.
"""

from __future__ import annotations

import logging
import os
from argparse import Namespace
from typing import Any, Protocol

from starlette.routing import Router

from sidecar.vllm_plugin.engine import SamplingParamsFactory, action_of
from sidecar.vllm_plugin.messages import HEALTH_PATH, RELEASE_PATH
from sidecar.vllm_plugin.service import ControlService, announce
from sidecar.vllm_plugin.settings import PluginSettings

log = logging.getLogger("vllm.kv_release")


class _App(Protocol):
    """The part of vLLM's FastAPI app the plugin touches."""

    @property
    def state(self) -> Any: ...

    @property
    def router(self) -> Router: ...


class KVReleasePlugin:
    """vLLM's ``EndpointPlugin`` protocol: ``name``, ``required_tasks``, ``attach_router``, ``init_state``."""

    name = "kv_release"
    # Releasing needs an engine that generates: not the render-only or a pooling server.
    required_tasks: tuple[str, ...] | None = ("generate",)

    def __init__(
        self, settings: PluginSettings | None = None, *, sampling_params: SamplingParamsFactory | None = None
    ) -> None:
        self._settings = settings if settings is not None else PluginSettings.from_environ(os.environ)
        self._sampling_params = sampling_params

    def attach_router(self, app: _App) -> None:
        """Add ``POST /kv_release/v1/release`` and ``GET /kv_release/v1/health`` (when enabled)."""
        announce(self._settings, "endpoint plugin")
        if not self._settings.enabled:
            return
        service = ControlService.of(app.state, self._settings, self._sampling_params)
        app.router.add_route(RELEASE_PATH, service.release, methods=["POST"], name="kv_release")
        app.router.add_route(HEALTH_PATH, service.health, methods=["GET"], name="kv_release_health")

    async def init_state(self, engine_client: object | None, state: Any, args: Namespace) -> None:
        """Say how this engine releases; the routes read ``state.engine_client`` per request."""
        if not self._settings.enabled:
            return
        action = action_of(engine_client) if engine_client is not None else None
        if action is None:
            log.warning("KV release control endpoint: no usable engine client; releases answer 503")
        else:
            log.info("KV release control endpoint: releases %s", _HOW[action])


_HOW = {
    "notify": "through EngineClient.notify_kv_transfer_request_rejected (vLLM's own fix)",
    "emulate": "by submitting a one-token request and aborting it at once (vLLM before 0.21.0)",
}
