"""The load side of ``python -m bench --workload releases``: prefill legs on P, then rejected requests
sent at a fixed rate.

Both run over plain keep-alive connections (``asyncio`` protocols parsing
answers with ``httptools``), cheap enough that the load generator keeps its
schedule at thousands of requests per second beside P and D on one core.
``prepare`` runs the prefill legs, each pinning one block on P, and keeps a
decode body D refuses (``max_tokens: "x"``) carrying P's parameters for each;
``OpenLoop`` sends them at a fixed rate whatever the earlier ones' fate (open
loop), over as many connections as that takes.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import cast

import httptools
import msgspec

from bench.harness.procs import BenchError
from bench.releases.launch import MODEL, PROMPT


class _Conn(asyncio.Protocol):
    """A keep-alive client connection; one request at a time, its answer to a callback."""

    def __init__(self, done: Callable[[_Conn, int, bytes], None]) -> None:
        self._done = done
        self._parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self._body: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self._parser.feed_data(data)

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self._done(self, 0, b"connection closed")  # a request on it, if any, failed

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        body, self._body = b"".join(self._body), []
        self._done(self, self._parser.get_status_code(), body)

    def send(self, route: str, body: bytes, headers: str = "") -> None:
        assert self.transport is not None
        head = f"POST {route} HTTP/1.1\r\nhost: bench\r\ncontent-type: application/json\r\n{headers}"
        self.transport.write(f"{head}content-length: {len(body)}\r\n\r\n".encode() + body)


async def _connect(url: str, done: Callable[[_Conn, int, bytes], None]) -> _Conn:
    host, _, port = url.removeprefix("http://").rpartition(":")
    _, conn = await asyncio.get_running_loop().create_connection(lambda: _Conn(done), host, int(port))
    return conn


async def prepare(prefill_url: str, count: int, connections: int) -> list[tuple[str, bytes]]:
    """``count`` prefill legs on P: (P's request id, a decode body D refuses carrying P's params)."""
    made: list[tuple[str, bytes]] = []
    left = [count]
    finished = asyncio.get_running_loop().create_future()
    body = msgspec.json.encode(
        {"model": MODEL, "prompt": PROMPT, "max_tokens": 1,
         "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False}}
    )  # fmt: skip

    def answered(conn: _Conn, status: int, data: bytes) -> None:
        params = msgspec.json.decode(data).get("kv_transfer_params") if status == 200 else None
        if not isinstance(params, dict):
            if not finished.done():
                finished.set_exception(BenchError(f"P answered {status}: {data[:200]!r}"))
            return
        decode = {"model": MODEL, "prompt": PROMPT, "max_tokens": "x", "kv_transfer_params": params}
        made.append((str(params["remote_request_id"]), msgspec.json.encode(decode)))
        if len(made) == count and not finished.done():
            finished.set_result(None)
        elif left[0] > 0:
            left[0] -= 1
            conn.send("/v1/completions", body)

    conns = [await _connect(prefill_url, answered) for _ in range(min(connections, count))]
    for conn in conns:
        left[0] -= 1
        conn.send("/v1/completions", body)
    try:
        await finished
    finally:
        for conn in conns:
            if conn.transport is not None:
                conn.transport.close()
    return made


class OpenLoop:
    """Sends prepared requests at a fixed rate over keep-alive connections (more when all are busy)."""

    def __init__(self, url: str) -> None:
        self._url = url
        self._idle: list[_Conn] = []
        self._all: list[_Conn] = []
        self.answered: dict[str, float] = {}  # P's request id -> when the client had the answer
        self.late: list[float] = []  # seconds each request went out behind its schedule
        self.answer: list[float] = []  # seconds from its schedule to its answer
        self.errors: list[str] = []
        self._pending: dict[_Conn, tuple[str, float]] = {}

    def _done(self, conn: _Conn, status: int, body: bytes) -> None:
        now = time.monotonic()
        pending = self._pending.pop(conn, None)
        if pending is None:  # an idle connection closed (the sidecar's keep-alive ran out)
            return
        rid, scheduled = pending
        if status == 400:
            self.answered[rid] = now
            self.answer.append(now - scheduled)
        elif len(self.errors) < 5:
            self.errors.append(f"{status}: {body[:200]!r}")
        if conn.transport is not None:
            self._idle.append(conn)

    async def run(self, bodies: list[tuple[str, bytes]], rate: float) -> float:
        """Send every body, ``1 / rate`` apart; returns when the last answer is in (or 10 s later)."""
        loop = asyncio.get_running_loop()
        start = loop.time()
        for index, (rid, body) in enumerate(bodies):
            due = start + index / rate
            if due > loop.time():
                await asyncio.sleep(due - loop.time())
            conn = await self._conn()
            self.late.append(loop.time() - due)
            self._pending[conn] = (rid, time.monotonic() - (loop.time() - due))
            conn.send("/v1/completions", body)
        deadline = loop.time() + 10
        while self._pending and loop.time() < deadline:  # noqa: ASYNC110 - answers come by callback
            await asyncio.sleep(0.01)  # poll for the last answers
        return loop.time() - start

    async def _conn(self) -> _Conn:
        """The most recently used idle connection still open, or a new one."""
        while self._idle:
            conn = self._idle.pop()
            if conn.transport is not None and not conn.transport.is_closing():
                return conn
        return await self._new()

    async def _new(self) -> _Conn:
        conn = await _connect(self._url, self._done)
        self._all.append(conn)
        return conn

    def close(self) -> None:
        for conn in self._all:
            if conn.transport is not None:
                conn.transport.close()
