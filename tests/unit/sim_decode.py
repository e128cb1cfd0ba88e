"""TODO docstring."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx

from sidecar.sim.decode import DecodeSimConfig, create_decode_app

CHAT, COMPLETIONS, RESPONSES = "/v1/chat/completions", "/v1/completions", "/v1/responses"


REMOTE = {"do_remote_prefill": True, "remote_request_id": "p-1", "remote_block_ids": [[1, 2]]}


class RecordingHooks:
    """DecodeHooks that remember every call."""

    def __init__(self, fail: bool = False) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.fail = fail

    async def admitted(self, request_id: str, route: str, kv_transfer_params: dict[str, Any]) -> None:
        self.calls.append(("admitted", request_id, route, kv_transfer_params))
        if self.fail:
            raise RuntimeError("hook failure")

    async def rejected_in_handler(
        self, request_id: str, route: str, kv_transfer_params: dict[str, Any], status: int
    ) -> None:
        self.calls.append(("rejected", request_id, route, kv_transfer_params, status))
        if self.fail:
            raise RuntimeError("hook failure")


@asynccontextmanager
async def sim(hooks: RecordingHooks | None = None, **knobs: Any) -> AsyncIterator[httpx.AsyncClient]:
    app = create_decode_app(DecodeSimConfig(**knobs), hooks)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://d") as client:
        yield client


def body_for(route: str, text: str = "hello there world", **extra: Any) -> dict[str, Any]:
    if route == CHAT:
        return {"model": "sim-model", "messages": [{"role": "user", "content": text}], **extra}
    if route == COMPLETIONS:
        return {"model": "sim-model", "prompt": text, **extra}
    return {"model": "sim-model", "input": text, **extra}


async def post(
    client: httpx.AsyncClient, route: str, body: Any, rid: str = "r1", headers: dict[str, str] | None = None
) -> httpx.Response:
    return await client.post(route, json=body, headers={"x-request-id": rid, **(headers or {})})


async def log(client: httpx.AsyncClient) -> list[dict[str, Any]]:
    response = await client.get("/sim/log")
    entries: list[dict[str, Any]] = response.json()
    return entries
