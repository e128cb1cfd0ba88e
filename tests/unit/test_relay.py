"""``ClientRelay``: which responses it takes, how it frames what it writes, and back-pressure."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from sidecar.server.cycle import UvicornCycle
from sidecar.transport.coalesce import CoalescingTransport
from sidecar.transport.relay import ClientRelay
from tests.fakes import FakeTransport


class Host:
    def __init__(self) -> None:
        self.current: ClientRelay | None = None

    def relaying(self, relay: ClientRelay | None) -> None:
        self.current = relay


class Reader:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def pause_relay(self) -> None:
        self.calls.append("pause")

    def resume_relay(self) -> None:
        self.calls.append("resume")


class Upper:
    def feed(self, chunk: bytes) -> bytes:
        return chunk.upper() if b"!" not in chunk else b""


def cycle(**state: Any) -> SimpleNamespace:
    base = {
        "chunked_encoding": True,
        "response_started": True,
        "response_complete": False,
        "disconnected": False,
        "transport": FakeTransport(),
        "flow": SimpleNamespace(write_paused=False),
    }
    return SimpleNamespace(**(base | state))


@pytest.mark.parametrize(
    "state",
    [
        {"chunked_encoding": False},  # content-length framed: uvicorn counts its bytes
        {"chunked_encoding": None},  # a HEAD response, or none started
        {"response_started": False},
        {"response_complete": True},
        {"disconnected": True},
    ],
    ids=["content-length", "no framing", "not started", "complete", "client gone"],
)
def test_a_response_it_cannot_frame_as_uvicorn_would_is_not_taken(state: dict[str, Any]) -> None:
    host = Host()
    relay = ClientRelay(host, UvicornCycle(cycle(**state)))
    assert relay.open(Reader()) is False
    assert host.current is None


def test_each_part_is_one_chunk_and_nothing_goes_to_a_client_that_left() -> None:
    host, reader, state = Host(), Reader(), cycle()
    relay = ClientRelay(host, UvicornCycle(state))
    assert relay.open(reader, Upper())
    assert host.current is relay
    relay.write(b"data: a\n\n")
    relay.write(b"held back!")  # the filter holds it: no empty chunk (that would end the body)
    state.disconnected = True
    relay.write(b"data: b\n\n")
    assert state.transport.writes == [b"9\r\nDATA: A\n\n\r\n"]
    relay.close()
    assert host.current is None


def test_back_pressure_reaches_d_and_a_full_client_at_the_start_pauses_d_at_once() -> None:
    reader = Reader()
    relay = ClientRelay(Host(), UvicornCycle(cycle(flow=SimpleNamespace(write_paused=True))))
    assert relay.open(reader)
    relay.resume()
    relay.pause()
    relay.close()
    relay.pause()  # after the relay closed: D's connection is no longer its business
    assert reader.calls == ["pause", "resume", "pause"]


async def test_a_head_still_held_back_goes_out_first_joined_with_the_first_part() -> None:
    inner = FakeTransport()
    coalescing = CoalescingTransport(inner, asyncio.get_running_loop())  # type: ignore[arg-type]
    coalescing.hold_next()
    coalescing.write(b"HTTP/1.1 200 OK\r\n\r\n")  # held for its body
    relay = ClientRelay(Host(), UvicornCycle(cycle(transport=coalescing)))
    assert relay.open(Reader())
    relay.write(b"data: a\n\n")
    relay.write(b"data: b\n\n")
    assert inner.writes == [b"HTTP/1.1 200 OK\r\n\r\n9\r\ndata: a\n\n\r\n", b"9\r\ndata: b\n\n\r\n"]


def test_the_parts_of_one_read_leave_in_one_write_each_its_own_chunk() -> None:
    state = cycle()
    relay = ClientRelay(Host(), UvicornCycle(state))
    assert relay.open(Reader(), Upper())
    relay.write_all([b"data: a\n\n", b"held!", b"data: bc\n\n"])
    relay.write_all([b"held!"])  # nothing left to write: no write at all
    assert state.transport.writes == [b"9\r\nDATA: A\n\n\r\na\r\nDATA: BC\n\n\r\n"]
