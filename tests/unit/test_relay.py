"""``ClientRelay``: which responses it takes, how it frames what it writes, and back-pressure."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from sidecar.server.cycle import Cycle
from sidecar.transport.relay import ClientRelay
from tests.support.fakes import FakeTransport


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


def cycle(write_paused: bool = False, **state: Any) -> Cycle:
    """A request's cycle whose chunked response has started, on a fake connection."""
    conn = SimpleNamespace(
        transport=FakeTransport(), loop=asyncio.new_event_loop(), write_paused=write_paused, logs_access=False
    )
    conn.loop.close()  # the cycles here schedule nothing
    made = Cycle(conn, {"method": "POST"}, keep_alive=True, expect_continue=False)  # type: ignore[arg-type]
    for name, value in ({"chunked": True, "response_started": True} | state).items():
        setattr(made, name, value)
    return made


@pytest.mark.parametrize(
    "state",
    [
        {"chunked": False},  # content-length framed (or a HEAD response): the server counts its bytes
        {"response_started": False},
        {"response_complete": True},
        {"disconnected": True},
    ],
    ids=["content-length", "not started", "complete", "client gone"],
)
def test_a_response_it_cannot_frame_as_the_server_would_is_not_taken(state: dict[str, Any]) -> None:
    host = Host()
    relay = ClientRelay(host, cycle(**state))
    assert relay.open(Reader()) is False
    assert host.current is None


def test_each_part_is_one_chunk_and_nothing_goes_to_a_client_that_left() -> None:
    host, reader, state = Host(), Reader(), cycle()
    relay = ClientRelay(host, state)
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
    relay = ClientRelay(Host(), cycle(write_paused=True))
    assert relay.open(reader)
    relay.resume()
    relay.pause()
    relay.close()
    relay.pause()  # after the relay closed: D's connection is no longer its business
    assert reader.calls == ["pause", "resume", "pause"]


async def test_a_head_still_held_back_goes_out_before_the_first_part() -> None:
    state = cycle(response_started=False, chunked=False)
    state._conn.loop = asyncio.get_running_loop()  # type: ignore[attr-defined]
    await state.send({"type": "http.response.start", "status": 200, "headers": []})  # held for its body
    assert state.transport.writes == []  # type: ignore[attr-defined]
    relay = ClientRelay(Host(), state)
    assert relay.open(Reader())  # the head leaves now: what the relay writes follows it
    relay.write(b"data: a\n\n")
    await asyncio.sleep(0)  # the end-of-iteration flush finds nothing left
    head, part = state.transport.writes  # type: ignore[attr-defined]
    assert head.startswith(b"HTTP/1.1 200 OK\r\n") and head.endswith(b"transfer-encoding: chunked\r\n\r\n")
    assert part == b"9\r\ndata: a\n\n\r\n"


def test_the_parts_of_one_read_leave_in_one_write_each_its_own_chunk() -> None:
    state = cycle()
    relay = ClientRelay(Host(), state)
    assert relay.open(Reader(), Upper())
    relay.write_all([b"data: a\n\n", b"held!", b"data: bc\n\n"])
    relay.write_all([b"held!"])  # nothing left to write: no write at all
    assert state.transport.writes == [b"9\r\nDATA: A\n\n\r\na\r\nDATA: BC\n\n\r\n"]
