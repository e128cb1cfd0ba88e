"""Ports for another process to bind: ``free_port``, the one helper every suite uses.

A server the test runs itself binds port 0 (``sidecar.sim.servers``): the port is known before it
serves and nothing can take it. A port handed to another process (a child sidecar, vLLM, a README
block) is picked here, below the kernel's ephemeral range where there is room: a port from that
range (what binding port 0 gives) can be taken, between the pick and the other process's bind, by
any outgoing connection on the machine (a vLLM engine opens dozens while it starts).
"""

from __future__ import annotations

import collections
import random
import socket
from pathlib import Path

LOW_PORT = 15000
# Ports this process handed out lately: never handed out again, so two picks for one test (a port
# and an admin port, a README's five) differ although each was free when picked.
_recent: collections.deque[int] = collections.deque(maxlen=2048)


def ephemeral_range(path: str = "/proc/sys/net/ipv4/ip_local_port_range") -> tuple[int, int]:
    """The kernel's range for outgoing connections' local ports (Linux's default if unreadable)."""
    try:
        low, high = (int(part) for part in Path(path).read_text().split())
    except (OSError, ValueError):
        return 32768, 60999
    return low, high


def free_port(count: int = 1, host: str = "127.0.0.1") -> int:
    """A port free now, for another process to bind; with ``count``, the first of that many
    consecutive free ports (D's data-parallel ranks, P's per-worker listeners).

    Picked below the ephemeral range where there is room (else by the kernel), never one this
    process handed out lately; each was bound once and released.
    """
    low, _ = ephemeral_range()
    room = low - LOW_PORT >= 1000 + count
    for attempt in range(200):  # below the range first, then the kernel's picks
        base = random.randrange(LOW_PORT, low - count + 1) if room and attempt < 100 else _kernel_pick(host)
        ports = range(base, base + count)
        if not any(port in _recent for port in ports) and _all_bind(host, ports):
            _recent.extend(ports)
            return base
    raise AssertionError(f"no {count} consecutive free port(s) on {host}")


def _kernel_pick(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _all_bind(host: str, ports: range) -> bool:
    socks: list[socket.socket] = []
    try:
        for port in ports:
            sock = socket.socket()
            socks.append(sock)
            sock.bind((host, port))
    except OSError:
        return False
    finally:
        for sock in socks:
            sock.close()
    return True


def listening(port: int, host: str = "127.0.0.1") -> bool:
    """Whether something accepts connections on ``port`` now."""
    with socket.socket() as sock:
        return sock.connect_ex((host, port)) == 0
