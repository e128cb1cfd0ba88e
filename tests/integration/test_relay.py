"""A stream's body after its first event goes straight from D's connection to the client's.

A real sidecar (dry-run, recording, the production server protocol) in front of
a Starlette D on loopback. The relay must change nothing a client or P can see:
every byte arrives in order, a first event that is an error is still judged
(and released) before anything else passes, a slow client holds D back instead
of filling the sidecar's memory, a client that leaves aborts D's stream, and a
read timeout counts D's silence only.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

from sidecar.sim.servers import serve
from sidecar.transport.relay import ClientRelay
from tests.support.runner import kv_params, run_sidecar

QUEUE_FULL = (
    "The engine is currently busy and cannot accept new requests. "
    "Please try again later or on a different instance."
)


class StreamingD:
    """D streaming ``events`` (each written on its own, ``delay`` seconds apart), counting what it
    produced and whether the client's leaving reached it."""

    def __init__(
        self,
        events: list[bytes],
        delay: float = 0.0,
        stall_after: int | None = None,
        gate: threading.Event | None = None,
    ) -> None:
        self.events, self.delay, self.stall_after, self.gate = events, delay, stall_after, gate
        self.produced = 0
        self.aborted = threading.Event()
        self.finished = threading.Event()

    def app(self) -> Starlette:
        async def answer(request: Request) -> StreamingResponse:
            await request.body()

            async def body() -> AsyncIterator[bytes]:
                try:
                    for index, event in enumerate(self.events):
                        if index == self.stall_after:
                            await asyncio.sleep(3600)
                        if index and self.delay:
                            await asyncio.sleep(self.delay)
                        if index == 1 and self.gate is not None:  # the rest once the test says so
                            assert await asyncio.to_thread(self.gate.wait, 30)
                        self.produced += len(event)
                        yield event
                    self.finished.set()
                except (asyncio.CancelledError, GeneratorExit):
                    self.aborted.set()
                    raise

            return StreamingResponse(body(), media_type="text/event-stream")

        return Starlette(routes=[Route("/v1/chat/completions", answer, methods=["POST"])])


def events(count: int, size: int = 0) -> list[bytes]:
    """``count`` chat chunks (padded to about ``size`` bytes), then ``[DONE]``."""
    out = []
    for index in range(count):
        delta = {"content": f" tok{index}" + "x" * size}
        out.append(b"data: " + json.dumps({"choices": [{"index": 0, "delta": delta}]}).encode() + b"\n\n")
    return [*out, b"data: [DONE]\n\n"]


def request(rid: str) -> dict[str, Any]:
    return {
        "model": "m",
        "stream": True,
        "messages": [{"role": "user", "content": "hi"}],
        "kv_transfer_params": kv_params(rid),
    }


@pytest.fixture
def relayed(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """The sizes of the parts the relay wrote to clients (the fast path taken)."""
    sizes: list[int] = []
    write_all = ClientRelay.write_all

    def counted(self: ClientRelay, parts: list[bytes]) -> None:
        sizes.extend(len(part) for part in parts)
        write_all(self, parts)

    monkeypatch.setattr(ClientRelay, "write_all", counted)
    yield sizes


def test_the_rest_of_a_stream_is_relayed_byte_for_byte(relayed: list[int]) -> None:
    sent = events(300) + events(3, size=200_000)  # small events, then some larger than any read
    # D writes the rest once the client has the first event: on a busy machine the sidecar's first
    # read could otherwise take in much more than that event, and less would go by the relay.
    gate = threading.Event()
    d = StreamingD(sent, gate=gate)
    with serve(d.app()) as server, run_sidecar(server.url) as sc:
        body = request("r1")
        with httpx.stream("POST", sc.url + "/v1/chat/completions", json=body, timeout=30) as response:
            assert response.status_code == 200
            chunks = response.iter_raw()
            received = next(chunks)
            gate.set()
            received += b"".join(chunks)
        assert received == b"".join(sent)
        assert sc.wait_idle()
        assert sc.released() == []  # a stream that began with a token: nothing to release
        # All but the first read (the first event, and what came with it) went by the relay, not
        # through the request's task.
        assert 0 < len(b"".join(sent)) - sum(relayed) < len(b"".join(sent)) // 10
        # The exchange ended cleanly: D's connection is pooled and serves the next stream.
        again = httpx.post(sc.url + "/v1/chat/completions", json=request("r2"), timeout=30)
        assert again.content == b"".join(sent)


def test_an_error_first_event_split_across_writes_is_judged_before_the_rest_passes(
    relayed: list[int],
) -> None:
    error = json.dumps(
        {"error": {"message": QUEUE_FULL, "type": "Service Unavailable", "param": None, "code": 503}},
        separators=(",", ":"),
    ).encode()
    first = b"data: " + error + b"\n\n"
    sent = [first[:20], first[20:], *events(50)]  # the judge needs both parts of the first event
    d = StreamingD(sent, delay=0.01)
    with serve(d.app()) as server, run_sidecar(server.url) as sc:
        response = httpx.post(sc.url + "/v1/chat/completions", json=request("overflow"), timeout=30)
        assert response.content == b"".join(sent)
        assert sc.wait_released(1) == ["overflow"]
        assert [job.cause.value for job in sc.releaser.recorded] == ["stream_admission_overflow"]
        # Only what followed the judged event was relayed.
        assert 0 < sum(relayed) <= len(b"".join(sent[2:]))


def _request_bytes(body: dict[str, Any]) -> bytes:
    data = json.dumps(body).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nhost: sidecar\r\ncontent-type: application/json\r\n"
        f"content-length: {len(data)}\r\n\r\n"
    ).encode()
    return head + data


def _settled(read: Any, interval: float = 0.05, rounds: int = 6, bound: float = 10.0) -> int:
    """Poll ``read()`` until it has not changed for ``rounds`` polls in a row (or ``bound`` s)."""
    last, still, deadline = read(), 0, time.monotonic() + bound
    while still < rounds and time.monotonic() < deadline:
        time.sleep(interval)  # a poll interval: what is measured is that the value stops moving
        now = read()
        still = still + 1 if now == last else 0
        last = now
    return int(last)


def test_a_client_that_reads_nothing_holds_d_back(relayed: list[int]) -> None:
    sent = events(4000, size=16_000)  # about 64 MB: more than every socket buffer on the way
    total = len(b"".join(sent))
    d = StreamingD(sent)
    with serve(d.app()) as server, run_sidecar(server.url) as sc:
        host, port = sc.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port))) as client:
            client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
            client.sendall(_request_bytes(request("slow")))
            held = _settled(lambda: d.produced)
            assert 0 < held < total // 2  # D was stopped while the client read nothing
            received = bytearray()
            client.settimeout(30)
            while not received.endswith(b"0\r\n\r\n"):
                chunk = client.recv(1 << 20)
                assert chunk, "the sidecar closed the connection"
                received += chunk
        assert d.finished.is_set() and d.produced == total
        assert b"data: [DONE]" in received and relayed


def test_a_client_leaving_mid_relay_aborts_d(relayed: list[int]) -> None:
    d = StreamingD(events(1000), delay=0.01)
    with serve(d.app()) as server, run_sidecar(server.url) as sc:
        host, port = sc.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port))) as client:
            client.sendall(_request_bytes(request("gone")))
            seen = b""
            while seen.count(b"data:") < 5:  # a few events in: the relay runs
                seen += client.recv(65536)
        assert d.aborted.wait(5), "D's stream went on after the client left"
        assert not d.finished.is_set() and relayed
        assert sc.wait_idle()  # the request's task ended with it


def test_a_read_timeout_counts_only_d_silence() -> None:
    steady = StreamingD(events(30), delay=0.1)  # 3 s in all, longer than the timeout, never silent
    stalled = StreamingD(events(12), stall_after=5)
    with serve(steady.app()) as a, serve(stalled.app()) as b:
        with run_sidecar(a.url, read_timeout=1.5) as sc:
            response = httpx.post(sc.url + "/v1/chat/completions", json=request("steady"), timeout=30)
            assert response.content == b"".join(steady.events)
        with run_sidecar(b.url, read_timeout=1.5) as sc:
            started = time.monotonic()
            with pytest.raises(httpx.RemoteProtocolError):  # the body is cut, never completed
                httpx.post(sc.url + "/v1/chat/completions", json=request("stalled"), timeout=30)
            assert time.monotonic() - started < 10
