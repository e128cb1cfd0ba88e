"""A finished request leaves nothing for the cyclic garbage collector.

Every request the sidecar answers is freed by reference counting as it ends.
One reference cycle per request (the server's cycle, its scope, the relay in
the scope pointing back at the cycle) cost a young collection every few dozen
requests and about 6 % of the sidecar's CPU per JSON request. A real
sidecar (the production server protocol) in front of a Starlette D answers
JSON and SSE requests carrying parameters, and the collector, saving what it
finds, must find none of their objects.
"""

from __future__ import annotations

import gc
import json
from collections.abc import AsyncIterator, Iterator

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from sidecar.sim.servers import serve
from tests.support.runner import kv_params, run_sidecar

EVENTS = [b'data: {"choices": [{"index": 0, "delta": {"content": "hi"}}]}\n\n', b"data: [DONE]\n\n"]
PER_REQUEST = ("Cycle", "ClientRelay", "RequestContext", "Exchange")


async def answer(request: Request) -> Response:
    body = await request.json()
    if not body.get("stream"):
        return JSONResponse({"id": "cmpl-1", "choices": [{"index": 0, "text": "hello"}]})

    async def events() -> AsyncIterator[bytes]:
        for event in EVENTS:
            yield event

    return StreamingResponse(events(), media_type="text/event-stream")


@pytest.fixture
def saved_garbage() -> Iterator[list[object]]:
    """``gc.garbage`` while the collector keeps everything it would free, emptied before and after."""
    gc.collect()
    gc.garbage.clear()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        yield gc.garbage
    finally:
        gc.set_debug(0)
        gc.garbage.clear()


def test_json_and_sse_requests_leave_no_reference_cycle(saved_garbage: list[object]) -> None:
    d = Starlette(routes=[Route("/v1/completions", answer, methods=["POST"])])
    with serve(d) as decode, run_sidecar(decode.url) as sc, httpx.Client(base_url=sc.url) as client:
        for n in range(40):
            stream = n % 2 == 1
            body = {"model": "m", "prompt": "p", "stream": stream, "kv_transfer_params": kv_params(f"r{n}")}
            response = client.post("/v1/completions", content=json.dumps(body))
            assert response.status_code == 200
            assert (b"[DONE]" in response.content) == stream
        assert sc.wait_idle()
        gc.collect()
        left = sorted({type(o).__name__ for o in saved_garbage} & set(PER_REQUEST))
    assert left == []
