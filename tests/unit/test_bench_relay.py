"""The relay (``python -m bench.servers.relay``) on real loopback sockets: bytes unchanged, back-pressure,
closing.

The relay runs as the benchmark runs it, a ``python -m bench.servers.relay`` child
process, here on an ephemeral port (``--port 0``) in front of a fake upstream
server in this test's event loop, also on an ephemeral port. Readiness is the
relay's own first stdout line, printed once it listens; every test then waits
on events (bytes read, connections accepted, ends of stream), never on
sleeps. Each test ends by sending ``SIGTERM`` and expecting exit status 0.
"""

from __future__ import annotations

import asyncio
import random
import signal
import socket
import struct
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HOST = "127.0.0.1"
TIMEOUT = 10.0
Pair = tuple[asyncio.StreamReader, asyncio.StreamWriter]


class Upstream:
    """A fake target: every connection the relay opens lands in ``accepted``, for the test to drive."""

    def __init__(self) -> None:
        self.accepted: asyncio.Queue[Pair] = asyncio.Queue()
        self.server: asyncio.Server | None = None
        self.writers: list[asyncio.StreamWriter] = []

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._accept, HOST, 0)
        return int(self.server.sockets[0].getsockname()[1])

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.writers.append(writer)
        await self.accepted.put((reader, writer))

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
        for writer in self.writers:
            writer.close()

    async def next(self) -> Pair:
        return await asyncio.wait_for(self.accepted.get(), TIMEOUT)


@dataclass
class Relay:
    process: asyncio.subprocess.Process
    port: int

    async def connect(self) -> Pair:
        return await asyncio.open_connection(HOST, self.port)

    def peak_rss_kib(self) -> int:
        """VmHWM of the relay process (its peak resident memory so far)."""
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
        raise AssertionError("no VmHWM")

    async def stop(self) -> int:
        if self.process.returncode is None:
            self.process.send_signal(signal.SIGTERM)
        return await asyncio.wait_for(self.process.wait(), TIMEOUT)


@pytest.fixture
async def upstream() -> AsyncIterator[Upstream]:
    server = Upstream()
    await server.start()
    yield server
    server.close()


@pytest.fixture
async def relay(upstream: Upstream) -> AsyncIterator[Relay]:
    assert upstream.server is not None
    target = upstream.server.sockets[0].getsockname()[1]
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "bench.servers.relay", "--host", HOST, "--port", "0",
        "--target", f"{HOST}:{target}",
        cwd=ROOT,
        stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        assert process.stdout is not None
        line = (await asyncio.wait_for(process.stdout.readline(), TIMEOUT)).decode()
        assert line.startswith(f"relay listening on {HOST}:"), line
        port = int(line.split()[3].rsplit(":", 1)[1])
        started = Relay(process, port)
        yield started
        assert await started.stop() == 0
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


async def read_exactly(reader: asyncio.StreamReader, size: int) -> bytes:
    return await asyncio.wait_for(reader.readexactly(size), TIMEOUT)


async def read_eof(reader: asyncio.StreamReader) -> bytes:
    """Whatever is left until the end of stream (a reset counts as an end too)."""
    try:
        return await asyncio.wait_for(reader.read(), TIMEOUT)
    except ConnectionResetError:
        return b""


def reset(writer: asyncio.StreamWriter) -> None:
    """Close with a TCP reset (SO_LINGER 0) instead of a FIN."""
    sock = writer.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


async def test_bytes_pass_unchanged_both_ways_on_one_upstream_connection_per_client(
    relay: Relay, upstream: Upstream
) -> None:
    request = b"POST /v1/chat/completions HTTP/1.1\r\nHost: d\r\n\r\n" + bytes(range(256)) * 16
    answer = b"HTTP/1.1 200 OK\r\ncontent-length: 4\r\n\r\n\x00\r\n\xff"
    clients = [await relay.connect() for _ in range(2)]
    ends = []
    for number, (_, client_writer) in enumerate(clients):
        client_writer.write(request + bytes([number]))
        up_reader, up_writer = await upstream.next()  # one upstream connection per client, in order
        assert await read_exactly(up_reader, len(request) + 1) == request + bytes([number])
        ends.append((up_reader, up_writer))
    for number, ((client_reader, _), (_, up_writer)) in enumerate(zip(clients, ends, strict=True)):
        up_writer.write(answer + bytes([number]))
        assert await read_exactly(client_reader, len(answer) + 1) == answer + bytes([number])
    assert upstream.accepted.empty()
    for _, client_writer in clients:
        client_writer.close()
    for up_reader, _ in ends:
        assert await read_eof(up_reader) == b""


async def test_a_large_transfer_round_trips_intact_with_bounded_relay_memory(
    relay: Relay, upstream: Upstream
) -> None:
    """32 MiB each way through an echo upstream, far more than the relay's write buffers hold."""
    size, chunk = 32 * 2**20, 2**20
    payload = random.Random(7).randbytes(size)
    client_reader, client_writer = await relay.connect()
    up_reader, up_writer = await upstream.next()
    peak_before = relay.peak_rss_kib()

    async def echo() -> None:
        while data := await up_reader.read(2**16):
            up_writer.write(data)
            await up_writer.drain()
        up_writer.close()

    async def send() -> None:
        for start in range(0, size, chunk):
            client_writer.write(payload[start : start + chunk])
            await client_writer.drain()

    echoing = asyncio.create_task(echo())
    sending = asyncio.create_task(send())
    received = await read_exactly(client_reader, size)
    await asyncio.wait_for(sending, TIMEOUT)
    assert received == payload
    client_writer.close()
    await asyncio.wait_for(echoing, TIMEOUT)  # the echo saw the end of stream the client's close caused
    # Without back-pressure the relay would hold whatever the slower side had not taken yet.
    assert relay.peak_rss_kib() - peak_before < 8 * 1024


@pytest.mark.parametrize("how", ["close", "reset"])
async def test_the_client_closing_closes_the_upstream_connection(
    relay: Relay, upstream: Upstream, how: str
) -> None:
    _, client_writer = await relay.connect()
    client_writer.write(b"ping")
    up_reader, _ = await upstream.next()
    assert await read_exactly(up_reader, 4) == b"ping"
    if how == "close":
        client_writer.close()
    else:
        reset(client_writer)
    assert await read_eof(up_reader) == b""


@pytest.mark.parametrize("how", ["close", "reset"])
async def test_the_upstream_closing_closes_the_client_connection(
    relay: Relay, upstream: Upstream, how: str
) -> None:
    client_reader, client_writer = await relay.connect()
    client_writer.write(b"ping")
    up_reader, up_writer = await upstream.next()
    assert await read_exactly(up_reader, 4) == b"ping"
    up_writer.write(b"last words")
    await up_writer.drain()
    if how == "close":
        up_writer.close()
        # What was sent before the close still arrives, then the end of stream.
        assert await read_eof(client_reader) == b"last words"
    else:
        assert await read_exactly(client_reader, 10) == b"last words"
        reset(up_writer)
        assert await read_eof(client_reader) == b""
    client_writer.close()


async def test_sigterm_closes_open_connections_and_exits_0(relay: Relay, upstream: Upstream) -> None:
    client_reader, client_writer = await relay.connect()
    client_writer.write(b"ping")
    up_reader, _ = await upstream.next()
    assert await read_exactly(up_reader, 4) == b"ping"
    assert await relay.stop() == 0
    assert await read_eof(client_reader) == b""
    assert await read_eof(up_reader) == b""
    client_writer.close()


async def test_a_refused_target_resets_the_client(relay: Relay, upstream: Upstream) -> None:
    assert upstream.server is not None
    upstream.server.close()
    await upstream.server.wait_closed()
    client_reader, client_writer = await relay.connect()
    assert await read_eof(client_reader) == b""
    client_writer.close()
