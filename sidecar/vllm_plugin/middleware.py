"""The middleware form: ``vllm serve ... --middleware sidecar.vllm_plugin.KVReleaseMiddleware``.

Works on every vLLM release with ``--middleware`` (0.9.2-0.34.0 checked): vLLM
imports the class and calls ``app.add_middleware(cls)``, so Starlette builds it
with the next ASGI app only, when the server starts. Requests under
``/kv_release/v1/`` are answered here (the route needs no FastAPI); every other
request passes through untouched. vLLM adds ``--middleware`` classes last, so
this one runs outermost, before vLLM's own ``--api-key`` check (whose prefixes
do not cover the route anyway). The engine client is read from
``scope["app"].state.engine_client``, which ``init_app_state`` sets at start-up.
"""

from __future__ import annotations

import os

from starlette.datastructures import State
from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from sidecar.vllm_plugin.engine import SamplingParamsFactory
from sidecar.vllm_plugin.messages import PREFIX
from sidecar.vllm_plugin.service import ControlService, announce
from sidecar.vllm_plugin.settings import PluginSettings


class KVReleaseMiddleware:
    """Pure ASGI middleware serving the control route in front of vLLM's app."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        settings: PluginSettings | None = None,
        sampling_params: SamplingParamsFactory | None = None,
    ) -> None:
        self.app = app
        self._settings = settings if settings is not None else PluginSettings.from_environ(os.environ)
        self._sampling_params = sampling_params
        self._own_state = State()  # used only when the outer app has no state (not Starlette)
        announce(self._settings, "middleware")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self._settings.enabled:
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        root = scope.get("root_path", "")
        if root and path.startswith(root):
            path = path[len(root) :]
        if not path.startswith(PREFIX):
            await self.app(scope, receive, send)
            return
        state = getattr(scope.get("app"), "state", None)  # never "or": an empty State is falsy
        if state is None:
            state = self._own_state
        service = ControlService.of(state, self._settings, self._sampling_params)
        response = await service.handle(Request(scope, receive), path)
        await response(scope, receive, send)
