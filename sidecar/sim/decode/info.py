"""The decode simulator's routes besides the completion ones.

vLLM's info endpoints (``/health``, ``/version``, ``/v1/models``,
``/metrics``, ``/tokenize``), the ``/sim/log`` and ``/sim/reset`` control
endpoints tests use, and the ``{"detail": ...}`` answer FastAPI gives for
unknown paths and methods. Bodies that never change are encoded once.
"""

from __future__ import annotations

import time

import msgspec
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from sidecar.sim.decode.config import DecodeSimConfig
from sidecar.sim.decode.engine import EngineState, nixl_metrics
from sidecar.sim.decode.rules import BodyView, ParsedRequest, Rejection, decode_view, validate
from sidecar.sim.decode.state import SimState


def info_routes(config: DecodeSimConfig, state: SimState, engine: EngineState) -> list[Route]:
    """Health, version, models, metrics, tokenize and the /sim control endpoints."""
    encoder = msgspec.json.Encoder()
    version = encoder.encode({"version": config.version})
    model = {
        "id": config.model,
        "object": "model",
        "created": int(time.time()),
        "owned_by": "vllm",
        "root": config.model,
        "parent": None,
        "max_model_len": config.max_model_len,
        "permission": [],
    }
    models = encoder.encode({"object": "list", "data": [model]})

    async def health(request: Request) -> Response:
        return Response(b"", 503 if engine.mode == "dead" else 200)  # vLLM: 503 on EngineDeadError

    async def get_version(request: Request) -> Response:
        return Response(version, media_type="application/json")

    async def get_models(request: Request) -> Response:
        return Response(models, media_type="application/json")

    async def metrics(request: Request) -> Response:
        text = _metrics_text(config, state, engine)
        return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    async def tokenize(request: Request) -> Response:
        view = decode_view(await request.body())
        parsed: ParsedRequest | Rejection = view if isinstance(view, Rejection) else _tokenize(view)
        if isinstance(parsed, Rejection):
            return Response(parsed.body, parsed.status, media_type="application/json")
        count = parsed.prompt_tokens
        answer = {"count": count, "max_model_len": config.max_model_len, "tokens": list(range(count))}
        return Response(encoder.encode({**answer, "token_strs": None}), media_type="application/json")

    async def sim_log(request: Request) -> Response:
        return Response(encoder.encode(list(state.log)), media_type="application/json")

    async def sim_reset(request: Request) -> Response:
        state.reset()
        return Response(status_code=204)

    return [
        Route("/health", health),
        Route("/version", get_version),
        Route("/v1/models", get_models),
        Route("/metrics", metrics),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/sim/log", sim_log),
        Route("/sim/reset", sim_reset, methods=["POST"]),
    ]


def _tokenize(view: BodyView) -> ParsedRequest | Rejection:
    """``/tokenize`` takes chat ``messages`` or a completion ``prompt``."""
    chat = view.messages is not msgspec.UNSET
    return validate("/v1/chat/completions" if chat else "/v1/completions", view)


def _metrics_text(config: DecodeSimConfig, state: SimState, engine: EngineState) -> bytes:
    """A tiny Prometheus exposition: vLLM's running gauge and, with a KV connector, NIXL's
    families (both only while vLLM logs stats), then the simulator's outcomes."""
    label = f'model_name="{config.model}"'
    lines = []
    if config.log_stats:
        lines += [
            "# HELP vllm:num_requests_running Number of requests in model execution batches.",
            "# TYPE vllm:num_requests_running gauge",
            f"vllm:num_requests_running{{{label}}} {float(state.unfinished)}",
        ]
        lines += nixl_metrics(config.model) if engine.kv_connector else []
    lines += [
        "# HELP sim_decode_requests_total Completion requests answered, by outcome.",
        "# TYPE sim_decode_requests_total counter",
    ]
    for outcome, count in sorted(state.outcomes.items()):
        lines.append(f'sim_decode_requests_total{{outcome="{outcome}"}} {float(count)}')
    return ("\n".join(lines) + "\n").encode()


async def http_error(request: Request, exc: Exception) -> Response:
    """FastAPI's answer to routing errors (vLLM keeps it): ``{"detail": "Not Found"}``."""
    assert isinstance(exc, HTTPException)
    return JSONResponse({"detail": exc.detail}, exc.status_code, headers=exc.headers)
