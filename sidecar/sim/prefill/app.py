"""``kv-release-sidecar sim-prefill``: a vLLM prefill node (P) with a real NIXL side.

``create_prefill_app(config)`` builds a Starlette app whose lifespan starts a
``PrefillSim`` (one NIXL agent per worker, the side-channel listener(s) and
the block pool) and stops it cleanly. Routes: the OpenAI completion routes, ``/v1/messages`` and
``/inference/v1/generate``
(a P/D prefill leg pins blocks until D's notifications or the lease free
them; a pool that cannot fit the prompt answers 503), ``/health``,
``/version``, ``/v1/models``, ``/metrics``, ``/stats``, and the test controls
``POST /sim/reset``, ``POST /sim/restart-agents``, ``POST /sim/freed`` and
``GET /sim/requests/{request_id}``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import msgspec
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from sidecar.config import ConfigError
from sidecar.sim.prefill.config import PrefillSimConfig, add_arguments, config_from_args
from sidecar.sim.prefill.metrics import build_registry
from sidecar.sim.prefill.openai import (
    REQUEST_DECODER,
    BadRequest,
    check_sampling,
    completion_body,
    count_tokens,
    error_body,
    models_body,
    wants_remote_decode,
)
from sidecar.sim.prefill.openai import Route as CompletionRoute
from sidecar.sim.prefill.pool import DuplicateRequest, PoolFull
from sidecar.sim.prefill.runtime import PrefillSim

__all__ = ["PrefillSimConfig", "add_arguments", "create_prefill_app", "run"]

_JSON = "application/json"
_ENCODER = msgspec.json.Encoder()


def _json(data: Any, status: int = 200) -> Response:
    return Response(_ENCODER.encode(data), status, media_type=_JSON)


def _sim(request: Request) -> PrefillSim:
    sim: PrefillSim = request.state.sim  # set by the lifespan
    return sim


def _error(
    request: Request, message: str, type_: str, status: int, route: CompletionRoute = "chat"
) -> Response:
    body = error_body(_sim(request).release, message, type_, status, route)
    return Response(body, status, media_type=_JSON)


async def _complete(request: Request, route: CompletionRoute) -> Response:
    sim = _sim(request)
    try:
        body = REQUEST_DECODER.decode(await request.body())
        tokens = count_tokens(route, body)
    except (msgspec.DecodeError, BadRequest) as exc:
        return _error(request, str(exc), "BadRequestError", 400)  # the request model's check
    try:
        check_sampling(route, body)
    except BadRequest as exc:  # SamplingParams, in the handler
        return _error(request, str(exc), "BadRequestError", 400, route)
    remote_decode = wants_remote_decode(body)
    try:
        outcome = sim.prefill(route, tokens, remote_decode, request.headers.get("x-request-id"))
    except PoolFull as exc:
        message = f"Not enough KV cache blocks for the request: {exc}"
        return _error(request, message, "ServiceUnavailableError", 503, route)
    except DuplicateRequest as exc:
        return _error(request, f"Request id {exc} already running.", "BadRequestError", 400, route)
    if sim.config.latency:
        await asyncio.sleep(sim.config.latency)  # the blocks stay pinned while P "computes"
    model = body.model if isinstance(body.model, str) else sim.config.model
    payload = completion_body(
        route,
        response_id=outcome.response_id,
        model=model,
        tokens=tokens,
        params=outcome.kv_transfer_params,
    )
    return Response(payload, media_type=_JSON)


async def completions(request: Request) -> Response:
    """``POST /v1/completions``."""
    return await _complete(request, "completions")


async def chat_completions(request: Request) -> Response:
    """``POST /v1/chat/completions``."""
    return await _complete(request, "chat")


async def messages(request: Request) -> Response:
    """``POST /v1/messages`` (Anthropic's Messages API, vLLM's chat handler underneath)."""
    return await _complete(request, "messages")


async def generate(request: Request) -> Response:
    """``POST /inference/v1/generate`` (vLLM's token-in generate route)."""
    return await _complete(request, "generate")


async def health(request: Request) -> Response:
    """``GET /health``: 200, empty body, like vLLM (it ignores the side channel)."""
    return Response(b"", 200)


async def version(request: Request) -> Response:
    """``GET /version``."""
    return _json({"version": _sim(request).release.version})


async def models(request: Request) -> Response:
    """``GET /v1/models``."""
    config = _sim(request).config
    body = models_body(config.model, config.num_blocks * config.block_size)
    return Response(body, 200, media_type=_JSON)


async def stats(request: Request) -> Response:
    """``GET /stats``: counters, pool, side channel and agents as JSON."""
    return _json(_sim(request).stats())


async def metrics(request: Request) -> Response:
    """``GET /metrics``: Prometheus text from the app's own registry."""
    return Response(generate_latest(request.state.registry), media_type=CONTENT_TYPE_LATEST)


async def reset(request: Request) -> Response:
    """``POST /sim/reset``: zero the counters (pinned requests stay pinned)."""
    sim = _sim(request)
    sim.reset_counters()
    return _json(sim.stats())


async def restart_agents(request: Request) -> Response:
    """``POST /sim/restart-agents``: new NIXL agents, new names, generation + 1."""
    sim = _sim(request)
    names = await asyncio.to_thread(sim.restart_agents)
    return _json({"agent_names": names, "registration_generation": sim.generation})


async def freed(request: Request) -> Response:
    """``POST /sim/freed``: every request freed since the last call, as ``[request_id, when, cause]``
    (``when``: ``time.monotonic()``, the same clock in every process of the machine)."""
    return _json({"freed": _sim(request).pool.take_freed()})


async def describe_request(request: Request) -> Response:
    """``GET /sim/requests/{request_id}``: pinned or not, and which ranks finished it."""
    request_id = request.path_params["request_id"]
    found = _sim(request).pool.describe(request_id)
    if found is None:
        return _error(request, f"request {request_id} was never pinned", "NotFoundError", 404)
    return _json(found)


def create_prefill_app(config: PrefillSimConfig) -> Starlette:
    """The simulated P as an ASGI app; the lifespan owns every thread, socket and agent."""

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[dict[str, Any]]:
        sim = PrefillSim(config)
        await asyncio.to_thread(sim.start)
        try:
            yield {"sim": sim, "registry": build_registry(sim.stats, config.model)}
        finally:
            await asyncio.to_thread(sim.stop)

    routes = [
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/messages", messages, methods=["POST"]),
        Route("/inference/v1/generate", generate, methods=["POST"]),
        Route("/health", health, methods=["GET"]),
        Route("/version", version, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/stats", stats, methods=["GET"]),
        Route("/sim/reset", reset, methods=["POST"]),
        Route("/sim/restart-agents", restart_agents, methods=["POST"]),
        Route("/sim/freed", freed, methods=["POST"]),
        Route("/sim/requests/{request_id:path}", describe_request, methods=["GET"]),
    ]
    return Starlette(routes=routes, lifespan=lifespan)


def run(args: argparse.Namespace) -> int:
    """Serve the simulator with uvicorn until interrupted; 2 on a bad config."""
    import uvicorn

    try:
        config = config_from_args(args)
    except ConfigError as exc:
        print(f"sim-prefill: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    uvicorn.run(create_prefill_app(config), host=config.host, port=config.port, log_level=config.log_level)
    return 0
