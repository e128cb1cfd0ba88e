"""A stream vLLM refuses after its 200 with a 503: released only when the event is unmistakable.

From vLLM 0.29.0, ``AsyncLLM._add_request`` checks the queue limits before the
engine core gets the request; a stream refused there has already answered 200,
so the refusal is the first SSE event. D's own fix saw a stream and does not
notify P. A real sidecar (dry-run, recording) in front of a D on loopback that
answers exactly what vLLM sends; the texts are pinned to vLLM's source in
``tests/conformance/test_vllm_coverage_source.py``.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

from sidecar.sim.servers import serve
from tests.support.runner import kv_params, run_sidecar

QUEUE_FULL = (
    "The engine is currently busy and cannot accept new requests. "
    "Please try again later or on a different instance."
)
BACKLOG = (
    "The engine has reached its prefill token backlog limit. "
    "Please try again later or on a different instance."
)
PAUSED = "Generation is paused. Please retry after it resumes."


def error_event(message: str, type_: str, compact: bool = True) -> str:
    """vLLM's in-band error: pydantic's compact JSON (0.33.0 chat) or ``json.dumps`` (0.29.0)."""
    error = {"error": {"message": message, "type": type_, "param": None, "code": 503}}
    return json.dumps(error, separators=(",", ":") if compact else None)


# (name, route, first event as vLLM writes it, release cause or None for "ambiguous, kept")
CASES = [
    (
        "chat, queue full (0.33.0)",
        "/v1/chat/completions",
        error_event(QUEUE_FULL, "Service Unavailable"),
        "stream_admission_overflow",
    ),
    (
        "completions, token backlog (0.29.0)",
        "/v1/completions",
        error_event(BACKLOG, "Service Unavailable", compact=False),
        "stream_admission_overflow",
    ),
    (
        "chat, paused engine (0.33.0)",
        "/v1/chat/completions",
        error_event(PAUSED, "InternalServerError"),
        "stream_engine_paused",
    ),
    ("a 503 with another text", "/v1/chat/completions", error_event("busy", "Service Unavailable"), None),
    (
        "the overflow text with another type",
        "/v1/completions",
        error_event(QUEUE_FULL, "ServiceUnavailableError"),
        None,
    ),
]


def d_answering(first_event: str) -> Starlette:
    async def refuse(request: Request) -> StreamingResponse:
        await request.body()

        async def events() -> AsyncIterator[bytes]:
            yield f"data: {first_event}\n\n".encode()
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    routes = [Route(path, refuse, methods=["POST"]) for path in ("/v1/chat/completions", "/v1/completions")]
    return Starlette(routes=routes)


@pytest.mark.parametrize(("name", "route", "event", "cause"), CASES, ids=[c[0] for c in CASES])
def test_stream_refused_after_200(name: str, route: str, event: str, cause: str | None) -> None:
    body: dict[str, Any] = {"model": "m", "stream": True, "kv_transfer_params": kv_params(name)}
    body |= {"messages": [{"role": "user", "content": "hi"}]} if "chat" in route else {"prompt": "hi"}
    with serve(d_answering(event)) as d, run_sidecar(d.url) as sc:
        response = httpx.post(sc.url + route, json=body, timeout=10)
        assert response.status_code == 200
        assert response.text == f"data: {event}\n\ndata: [DONE]\n\n"  # passed through untouched
        sc.settle()
        if cause is None:
            assert sc.released() == []
            assert sc.sample("kvr_not_released_total", outcome="ambiguous", cause="stream_error_5xx") == 1
        else:
            assert sc.released() == [name]
            assert [job.cause for job in sc.releaser.recorded] == [cause]
            assert sc.sample("kvr_rejections_total", cause=cause) == 1
