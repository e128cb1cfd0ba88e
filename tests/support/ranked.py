"""Servers on consecutive loopback ports: D's data-parallel ranks (one API port per rank).

``ranked`` runs one sim-decode on each of
``base``, ``base + 1``, ... on real uvicorn servers (``sidecar.sim.servers``).
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from sidecar.sim.decode import create_decode_app
from sidecar.sim.decode.config import DecodeSimConfig
from sidecar.sim.servers import ServerThread


@contextmanager
def ranked(
    configs: list[DecodeSimConfig], base: int, hooks: Callable[[], Any] | None = None
) -> Iterator[list[ServerThread]]:
    """sim-decode servers on ``base``, ``base + 1``, ...: D's data-parallel API ports, each with
    its own ``hooks()`` when given."""
    servers = []
    try:
        for offset, config in enumerate(configs):
            server = ServerThread(create_decode_app(config, hooks() if hooks else None))
            server.socks[0].close()
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("127.0.0.1", base + offset))
            sock.listen(128)
            server.socks, server.ports = [sock], [base + offset]
            server.port, server.url = base + offset, f"http://127.0.0.1:{base + offset}"
            servers.append(server.start())
        yield servers
    finally:
        for server in servers:
            server.stop()
