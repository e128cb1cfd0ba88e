"""Fake vLLM engine clients: the part of ``EngineClient`` the control-endpoint plugin uses.

``NotifyEngine`` is ``AsyncLLM`` of vLLM 0.21.0+: ``notify_kv_transfer_request_rejected``
(and ``generate``/``abort``, which the plugin must then leave alone).
``LegacyEngine`` is ``AsyncLLM`` of 0.9.2-0.20.x: ``generate`` is an async
generator that submits the request before waiting on its output queue, and on
cancellation or close aborts the request itself; ``abort`` drops a live request
and, like D's NIXL connector for a request aborted before scheduling, releases
it. ``mode`` picks what the engine does next:

* ``hang``: an aborted stream never ends (0.9.2-0.13.x: the output processor just
  forgets the request), the caller has to cancel it;
* ``finish``: an aborted stream ends with a final output whose reason is ``abort``;
* ``admit``: the scheduler runs the request before any abort: D reads, releases,
  and the stream yields its one token;
* ``refuse``: ``generate`` raises ``ValueError`` (an out-of-range DP rank, say).

``on_release(request_id, kv_transfer_params)`` is awaited for every release the
engine performs, e.g. the decode simulator's NIXL client notifying P.
"""

from __future__ import annotations

import asyncio
from argparse import Namespace
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

from fastapi import FastAPI
from starlette.responses import JSONResponse, Response

from sidecar.vllm_plugin import (
    KVReleaseMiddleware,
    KVReleasePlugin,
    PluginSettings,
)

OnRelease = Callable[[str, dict[str, Any]], Awaitable[Any]]
Mode = Literal["hang", "finish", "admit", "refuse"]


def sampling_params(kv_transfer_params: dict[str, Any]) -> dict[str, Any]:
    """Stands in for vLLM's ``SamplingParams(max_tokens=1, extra_args=...)`` in tests."""
    return {"max_tokens": 1, "extra_args": {"kv_transfer_params": dict(kv_transfer_params)}}


@dataclass
class Completion:
    finish_reason: str | None


@dataclass
class Output:
    request_id: str
    finished: bool
    outputs: list[Completion] = field(default_factory=list)


class NotifyEngine:
    """vLLM 0.21.0+."""

    def __init__(self, on_release: OnRelease | None = None, *, fail: Exception | None = None) -> None:
        self.on_release = on_release
        self.fail = fail
        self.notified: list[tuple[str, dict[str, Any], int | None]] = []
        self.gate: asyncio.Event | None = None  # set: notify waits on it (concurrency tests)

    async def notify_kv_transfer_request_rejected(
        self, request_id: str, kv_transfer_params: dict[str, Any], *, data_parallel_rank: int | None = None
    ) -> None:
        if self.gate is not None:
            await self.gate.wait()
        if self.fail is not None:
            raise self.fail
        self.notified.append((request_id, kv_transfer_params, data_parallel_rank))
        if self.on_release is not None:
            await self.on_release(request_id, kv_transfer_params)

    def generate(self, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        raise AssertionError("vLLM 0.21.0+: the plugin must use notify_kv_transfer_request_rejected")

    async def abort(self, request_id: str) -> None:
        raise AssertionError("vLLM 0.21.0+: the plugin must use notify_kv_transfer_request_rejected")


class LegacyEngine:
    """vLLM 0.9.2-0.20.x (see the module docstring for ``mode``)."""

    def __init__(self, mode: Mode = "hang", on_release: OnRelease | None = None) -> None:
        self.mode = mode
        self.on_release = on_release
        self.submitted: list[tuple[str, dict[str, Any], dict[str, Any], int | None]] = []
        self.aborted: list[str] = []
        self.released: list[str] = []
        self.closed: list[str] = []  # streams that ran their cleanup
        self.keywords: list[dict[str, Any]] = []
        self._live: dict[str, tuple[asyncio.Queue[Output], dict[str, Any]]] = {}

    async def generate(
        self, prompt: Any, sampling_params: Any, request_id: str, **kwargs: Any
    ) -> AsyncIterator[Output]:
        """``**kwargs`` records which keywords the caller passed (0.9.2's protocol lacks the rank)."""
        self.keywords.append(kwargs)
        data_parallel_rank = kwargs.get("data_parallel_rank")
        try:
            await asyncio.sleep(0)  # add_request awaits before it sends (get_supported_tasks, ZMQ)
            if self.mode == "refuse":
                raise ValueError(f"data_parallel_rank {data_parallel_rank} is out of range")
            params = sampling_params["extra_args"]["kv_transfer_params"]
            queue: asyncio.Queue[Output] = asyncio.Queue()
            self._live[request_id] = (queue, params)
            self.submitted.append((request_id, prompt, params, data_parallel_rank))
            if self.mode == "admit":
                await self._release(request_id)
                queue.put_nowait(Output(request_id, True, [Completion("length")]))
            while True:
                out = await queue.get()
                yield out
                if out.finished:
                    return
        except (asyncio.CancelledError, GeneratorExit):
            await self.abort(request_id)
            raise
        finally:
            self.closed.append(request_id)

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)
        live = self._live.get(request_id)
        if live is None:
            return
        await self._release(request_id)
        if self.mode == "finish":
            live[0].put_nowait(Output(request_id, True, [Completion("abort")]))

    async def _release(self, request_id: str) -> None:
        live = self._live.pop(request_id, None)
        if live is None:
            return
        self.released.append(request_id)
        if self.on_release is not None:
            await self.on_release(request_id, live[1])


TOKEN = "integration-token-0123456789"


SETTINGS = PluginSettings(token=TOKEN, emulate_grace=0.05, emulate_settle=0.05)


def vllm_like(
    engine: object | None,
    *,
    plugin: bool = True,
    middleware: bool = False,
    settings: PluginSettings = SETTINGS,
    version: str = "0.33.0",
) -> FastAPI:
    """vLLM's build_app + init_app_state, reduced: core routes, then plugins, then middleware."""
    endpoint = KVReleasePlugin(settings, sampling_params=sampling_params)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.engine_client = engine  # init_app_state
        if plugin:
            await endpoint.init_state(engine, app.state, Namespace())
        yield

    app = FastAPI(lifespan=lifespan)

    async def health() -> Response:
        return Response(b"")

    async def get_version() -> dict[str, str]:
        return {"version": version}

    async def completions() -> JSONResponse:  # a body that fails validation, before the handler
        error = {"message": "max_tokens: Input should be a valid integer", "type": "Bad Request"}
        return JSONResponse({"error": {**error, "param": None, "code": 400}}, status_code=400)

    async def chat() -> JSONResponse:  # a rejection raised inside the handler (D's fix covers it)
        error = {"message": "prompt too long", "type": "BadRequestError", "param": None, "code": 400}
        return JSONResponse({"error": error}, status_code=400)

    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/version", get_version, methods=["GET"])
    app.add_api_route("/v1/completions", completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", chat, methods=["POST"])
    if plugin:
        endpoint.attach_router(app)
    if middleware:
        app.add_middleware(KVReleaseMiddleware, settings=settings, sampling_params=sampling_params)
    return app
