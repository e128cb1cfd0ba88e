"""The decode simulator behind real uvicorn: SSE flushed per event, cut streams, real disconnects."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from sidecar.sim.decode import DecodeSimConfig, create_decode_app
from sidecar.sim.servers import serve

REMOTE = {"do_remote_prefill": True, "remote_request_id": "p-7", "remote_block_ids": [[3]]}


def chat(text: str, **extra: Any) -> dict[str, Any]:
    return {"model": "sim-model", "messages": [{"role": "user", "content": text}], **extra}


class RecordingHooks:
    """DecodeHooks that remember every call (they run on the server's thread)."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    async def admitted(self, request_id: str, route: str, kv_transfer_params: dict[str, Any]) -> None:
        self.calls.append(("admitted", request_id))

    async def rejected_in_handler(
        self, request_id: str, route: str, kv_transfer_params: dict[str, Any], status: int
    ) -> None:
        self.calls.append(("rejected", request_id, status))


async def next_event(chunks: Any, buffer: bytearray) -> bytes:
    """Read raw bytes until one whole SSE event is buffered; return it."""
    while b"\n\n" not in buffer:
        buffer.extend(await anext(chunks))
    event, _, rest = bytes(buffer).partition(b"\n\n")
    buffer[:] = rest
    return event


async def test_first_event_arrives_while_the_rest_is_still_being_produced() -> None:
    # 3 events 30 s apart: only an unbuffered server delivers the first within the timeout.
    app = create_decode_app(DecodeSimConfig(stream_events=3, event_delay=30.0))
    with serve(app) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=5.0) as client:
            body = chat("hello", stream=True)
            async with client.stream("POST", "/v1/chat/completions", json=body) as response:
                assert response.status_code == 200
                assert response.headers["content-type"].startswith("text/event-stream")
                chunks, buffer = response.aiter_raw(), bytearray()
                async with asyncio.timeout(5.0):
                    first = await next_event(chunks, buffer)
                assert first.startswith(b'data: {"id":"chatcmpl-')
                assert b'"delta":{"role":"assistant","content":"t0"}' in first
                assert b"t1" not in buffer
            log = (await client.get("/sim/log")).json()
    assert [(entry["outcome"], entry["stream"]) for entry in log] == [("admitted", True)]


async def test_drop_mid_stream_cuts_the_connection_after_drop_after_events() -> None:
    app = create_decode_app(DecodeSimConfig(stream_events=8, drop_after=2))
    received: list[bytes] = []
    with serve(app) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=5.0) as client:
            body = chat("go [[drop-mid-stream]]", stream=True)
            async with client.stream("POST", "/v1/chat/completions", json=body) as response:
                assert response.status_code == 200
                chunks, buffer = response.aiter_raw(), bytearray()
                with pytest.raises(httpx.RemoteProtocolError):
                    while True:
                        received.append(await next_event(chunks, buffer))
            log = (await client.get("/sim/log")).json()
    assert len(received) == 2 and all(event.startswith(b"data: {") for event in received)
    assert (log[0]["outcome"], log[0]["admitted"]) == ("dropped", True)


async def test_client_leaving_a_hung_request_cancels_it_in_the_handler() -> None:
    hooks = RecordingHooks()
    app = create_decode_app(DecodeSimConfig(), hooks)
    with serve(app) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=5.0) as client:
            body = chat("wait [[hang]]", kv_transfer_params=REMOTE)
            headers = {"x-request-id": "gone"}
            with pytest.raises(httpx.ReadTimeout):
                await client.post("/v1/chat/completions", json=body, headers=headers, timeout=0.3)
            for _ in range(500):  # the server notices the closed socket on its own loop
                log = (await client.get("/sim/log")).json()
                if log[0]["outcome"] != "pending":
                    break
                await asyncio.sleep(0.01)
    assert (log[0]["outcome"], log[0]["status"], log[0]["origin"]) == ("cancelled", 499, "handler")
    assert hooks.calls == [("rejected", "gone", 499)]
