"""A client that leaves in the middle of a chunked upload: D must never see a complete request.

The sidecar re-frames a passthrough body for D. If the client goes away (or the sidecar's own
body timeout fires) mid-body, the request to D is aborted, never terminated with ``0\\r\\n\\r\\n``:
D would otherwise act on half a body as if it were whole.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import pytest

from tests.support.runner import run_sidecar
from tests.support.until import until


class RecordingD:
    """A TCP listener standing in for D: records every byte of each connection until it ends."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.received = bytearray()
        self.ended = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        conn, _ = self.sock.accept()
        with conn:
            try:
                while data := conn.recv(65536):
                    self.received += data
            except ConnectionResetError:
                pass
        self.ended.set()

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def recording_d() -> Iterator[RecordingD]:
    d = RecordingD()
    yield d
    d.close()


def test_client_leaving_mid_chunked_upload_aborts_the_request_to_d(recording_d: RecordingD) -> None:
    with run_sidecar(recording_d.url, decode_health_interval=0) as sc:  # D here takes one connection
        host, port = sc.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port))) as client:
            client.sendall(
                b"POST /v1/files HTTP/1.1\r\nhost: sidecar\r\ntransfer-encoding: chunked\r\n\r\n"
                b'8\r\n{"half":\r\n'
            )
            got = lambda: bytes(recording_d.received)  # noqa: E731
            until(lambda: b'{"half":' in got(), "D's first chunk", 5.0, 0.005, state=got)  # then leave
        assert recording_d.ended.wait(5), "the sidecar kept the request to D open"
    assert b"transfer-encoding: chunked" in recording_d.received.lower()
    assert not recording_d.received.endswith(b"0\r\n\r\n"), bytes(recording_d.received)
    assert b"\r\n0\r\n\r\n" not in recording_d.received
