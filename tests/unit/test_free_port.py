"""``free_port`` picks a port that no outgoing connection can take before another process binds it."""

from __future__ import annotations

import itertools
import socket
from pathlib import Path

import pytest

from tests.support import ports


def test_a_port_below_the_ephemeral_range_that_binds() -> None:
    low, _ = ports.ephemeral_range()
    if low - ports.LOW_PORT < 1000:
        pytest.skip(f"this kernel's ephemeral range starts at {low}: no room below it")
    for _ in range(20):
        port = ports.free_port()
        assert ports.LOW_PORT <= port < low
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))  # free: the pick's own socket is closed


def test_a_port_in_use_is_never_picked(monkeypatch: pytest.MonkeyPatch) -> None:
    taken = socket.create_server(("127.0.0.1", 0))
    port = taken.getsockname()[1]
    # The taken port twice, then ports below the range until one is free (another test may hold
    # the next one for a moment): never the taken one.
    picks = itertools.chain([port, port], range(ports.LOW_PORT, ports.LOW_PORT + 5000))
    monkeypatch.setattr(ports, "ephemeral_range", lambda: (ports.LOW_PORT + 5000, 60999))
    monkeypatch.setattr(ports.random, "randrange", lambda low, high: next(picks))
    with taken:
        assert ports.free_port() != port


def test_with_no_room_below_the_range_the_kernel_picks(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_pick(low: int, high: int) -> int:
        raise AssertionError("picked below a range with no room under it")

    monkeypatch.setattr(ports, "ephemeral_range", lambda: (ports.LOW_PORT + 10, 60999))
    monkeypatch.setattr(ports.random, "randrange", no_pick)
    port = ports.free_port()
    assert port > 0


def test_a_count_gives_the_first_of_that_many_consecutive_free_ports(monkeypatch: pytest.MonkeyPatch) -> None:
    taken = socket.create_server(("127.0.0.1", 0))
    port = taken.getsockname()[1]
    # A base whose second port is taken, then a free range: the taken one is never in what is given.
    picks = itertools.chain([port - 1], range(ports.LOW_PORT, ports.LOW_PORT + 5000, 7))
    monkeypatch.setattr(ports, "ephemeral_range", lambda: (ports.LOW_PORT + 5000, 60999))
    monkeypatch.setattr(ports.random, "randrange", lambda low, high: next(picks))
    with taken:
        base = ports.free_port(3)
    assert port not in range(base, base + 3)
    for offset in range(3):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", base + offset))


def test_a_port_handed_out_is_not_handed_out_again(monkeypatch: pytest.MonkeyPatch) -> None:
    first = ports.free_port()
    picks = itertools.chain([first, first], range(ports.LOW_PORT, ports.LOW_PORT + 5000))
    monkeypatch.setattr(ports, "ephemeral_range", lambda: (ports.LOW_PORT + 5000, 60999))
    monkeypatch.setattr(ports.random, "randrange", lambda low, high: next(picks))
    assert ports.free_port() != first  # free again, but handed out already


def test_the_range_is_read_from_the_kernel_file_or_defaults(tmp_path: Path) -> None:
    ranges = tmp_path / "ip_local_port_range"
    ranges.write_text("40000\t50000\n")
    assert ports.ephemeral_range(str(ranges)) == (40000, 50000)
    assert ports.ephemeral_range(str(tmp_path / "missing")) == (32768, 60999)
