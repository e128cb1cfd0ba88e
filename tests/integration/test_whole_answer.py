"""D's JSON answer, whole when its head arrives, reaches the client in one write and unchanged.

A real sidecar (the production server protocol, dry-run) in front of a
Starlette D on loopback; a raw keep-alive socket client compares every byte
with what D sends. The one-write path must change nothing a client sees
(status, headers, body, the connection kept or closed) and must not take
what it cannot frame (a chunked JSON answer, D's refusals, which are judged
from their body).
"""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from sidecar.proxy.handler import WHOLE_LIMIT
from sidecar.sim.servers import serve
from sidecar.transport.relay import ClientRelay
from tests.support.runner import kv_params, run_sidecar

ANSWER = {"id": "cmpl-1", "object": "chat.completion", "choices": [{"index": 0, "message": {"content": "x"}}]}
REFUSAL = {"error": {"message": "max_tokens is too large", "type": "BadRequestError", "code": 400}}


def d_app() -> Starlette:
    async def chat(request: Request) -> Response:
        body = await request.json()
        kind = body.get("kind")
        if kind == "chunked":  # JSON with no length: D frames it chunked

            async def parts() -> AsyncIterator[bytes]:
                yield json.dumps(ANSWER).encode()

            return StreamingResponse(parts(), media_type="application/json")
        if kind == "refused":
            return JSONResponse(REFUSAL, status_code=400)
        return JSONResponse(ANSWER, headers={"x-d": "yes"})

    return Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])])


@pytest.fixture
def answered(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[bool]]:
    """Each ``ClientRelay.answer`` outcome (True: the answer left in one write)."""
    outcomes: list[bool] = []
    answer = ClientRelay.answer

    def counted(self: ClientRelay, status: int, head: list[tuple[bytes, bytes]], body: bytes) -> bool:
        outcomes.append(answer(self, status, head, body))
        return outcomes[-1]

    monkeypatch.setattr(ClientRelay, "answer", counted)
    yield outcomes


Answer = tuple[bytes, dict[bytes, bytes], bytes]


def post(sock: socket.socket, body: dict[str, Any], close: bool = False) -> Answer:
    """One request on ``sock``; the status line, the headers and the body as read off the wire."""
    data = json.dumps(body).encode()
    extra = b"connection: close\r\n" if close else b""
    sock.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: sidecar\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n%s\r\n%s" % (len(data), extra, data)
    )
    reader = sock.makefile("rb")
    status = reader.readline()
    headers: dict[bytes, bytes] = {}
    while (line := reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.partition(b":")
        headers[name.strip().lower()] = value.strip()
    if b"content-length" in headers:
        payload = reader.read(int(headers[b"content-length"]))
    else:  # chunked
        payload = b""
        while size := int(reader.readline().strip(), 16):
            payload += reader.read(size)
            reader.readline()
        reader.readline()
    return status, headers, payload


def request(rid: str, **extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [], "kv_transfer_params": kv_params(rid), **extra}


def test_a_whole_json_answer_is_what_d_sent_and_the_connection_serves_the_next(answered: list[bool]) -> None:
    with serve(d_app()) as d, run_sidecar(d.url) as sc:
        host, port = sc.url.removeprefix("http://").split(":")
        direct_host, direct_port = d.url.removeprefix("http://").split(":")
        with socket.create_connection((direct_host, int(direct_port)), timeout=30) as direct:
            _, d_headers, d_body = post(direct, request("r0"))
        with socket.create_connection((host, int(port)), timeout=30) as sock:
            for rid in ("r1", "r2", "r3"):  # one keep-alive connection
                status, headers, body = post(sock, request(rid))
                assert status == b"HTTP/1.1 200 OK\r\n" and body == d_body and json.loads(body) == ANSWER
                assert headers[b"content-length"] == d_headers[b"content-length"]
                assert headers[b"content-type"] == b"application/json" and headers[b"x-d"] == b"yes"
                assert headers[b"x-request-id"] and b"connection" not in headers
            status, headers, body = post(sock, request("r4"), close=True)
            assert body == d_body and headers[b"connection"] == b"close"
            assert sock.recv(1) == b""  # closed after the answer, as the client asked
        assert sc.wait_idle()  # every request's task ended (the client may read before it does)
        assert answered == [True, True, True, True]
        assert sc.released() == []  # admitted by D: nothing released


def test_a_chunked_json_answer_and_a_refusal_take_the_server_path(answered: list[bool]) -> None:
    with serve(d_app()) as d, run_sidecar(d.url) as sc:
        host, port = sc.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=30) as sock:
            status, headers, body = post(sock, request("c1", kind="chunked"))
            assert status == b"HTTP/1.1 200 OK\r\n" and json.loads(body) == ANSWER
            assert headers[b"transfer-encoding"] == b"chunked"
            status, _, body = post(sock, request("c2", kind="refused"))
            assert status == b"HTTP/1.1 400 Bad Request\r\n" and json.loads(body) == REFUSAL
            status, _, body = post(sock, request("c3"))  # the connection still serves
            assert status == b"HTTP/1.1 200 OK\r\n" and json.loads(body) == ANSWER
        assert sc.wait_idle()  # every request's task ended (the client may read before it does)
        # The chunked answer may have arrived whole or not: either way it is never framed by the
        # one-write path (it names no length). The refusal never reaches it (judged from its body).
        assert answered[-1] is True and True not in answered[:-1]
        assert sc.wait_released(1) == ["c2"]  # D's refusal before admission: released


def test_a_large_answer_passes_whole_and_a_cut_one_stays_cut(answered: list[bool]) -> None:
    # Over the limit: the head and what was read go first, the rest is pumped, every byte in order.
    # A body D breaks off before its declared length: the client gets it cut (its connection
    # aborted), never a complete answer nor an error answer a proxy in front could retry.
    large = b'{"pad":"' + b"x" * (WHOLE_LIMIT * 3) + b'"}'
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def d() -> None:
        answers = [(large, len(large)), (b'{"cut":', 100)]
        while answers:
            conn, _ = listener.accept()
            with conn:
                request = b""
                while b"\r\n\r\n" not in request:
                    request += conn.recv(65536)
                head, _, rest = request.partition(b"\r\n\r\n")
                if not head.startswith(b"POST /v1/chat/completions "):  # the sidecar's probes of D
                    conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
                    continue
                length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                while len(rest) < length:
                    rest += conn.recv(65536)
                body, declared = answers.pop(0)
                conn.sendall(
                    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
                    b"connection: close\r\n\r\n%s" % (declared, body)
                )

    thread = threading.Thread(target=d, daemon=True)
    thread.start()
    with listener, run_sidecar(f"http://127.0.0.1:{port}") as sc:
        got = httpx.post(sc.url + "/v1/chat/completions", json=request("big"), timeout=30)
        assert got.status_code == 200 and got.content == large
        with pytest.raises(httpx.RemoteProtocolError):  # cut, as D cut it
            httpx.post(sc.url + "/v1/chat/completions", json=request("cut"), timeout=30)
        assert sc.wait_idle()
        assert answered == []  # neither was whole within the limit
        thread.join(10)
