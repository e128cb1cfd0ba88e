"""A 304 from D that names a content-length passes through, and the connection stays usable."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import pytest

from tests.support.runner import run_sidecar

NOT_MODIFIED = b'HTTP/1.1 304 Not Modified\r\netag: "v1"\r\ncontent-length: 10\r\n\r\n'


@pytest.fixture
def d_answering_304() -> Iterator[str]:
    server = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            with conn:
                buffer = b""
                while data := conn.recv(65536):
                    buffer += data
                    while b"\r\n\r\n" in buffer:  # bodiless GETs: one answer per header block
                        _, _, buffer = buffer.partition(b"\r\n\r\n")
                        conn.sendall(NOT_MODIFIED)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.getsockname()[1]}"
    server.close()


def test_304_with_a_content_length_reaches_the_client(d_answering_304: str) -> None:
    with run_sidecar(d_answering_304, decode_health_interval=0) as sc:  # D here answers one request
        host, port = sc.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=5) as client:
            for _ in range(2):  # the same connection serves the next request: it was not broken
                client.sendall(b'GET /v1/models HTTP/1.1\r\nhost: x\r\nif-none-match: "v1"\r\n\r\n')
                head = b""
                while b"\r\n\r\n" not in head:
                    data = client.recv(65536)
                    assert data, "the sidecar closed the connection"
                    head += data
                assert head.startswith(b"HTTP/1.1 304 ") and b'etag: "v1"' in head
