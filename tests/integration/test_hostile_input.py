"""Hostile and malformed input against a real sidecar in front of the fake vLLM decode server.

Each hostile input gets a defined answer (docs/limits.md): slow or endless
header blocks, idle and slow-body connections are cut by the server's own
timers and size limit (``sidecar.server.protocol.GuardedProtocol``), oversized bodies get
vLLM's 413, unreadable JSON is forwarded for D to answer, and malformed
parameters are never released while odd but valid ids are released intact.
The sidecars here run the production HTTP protocol and limits
(``sidecar.server.host.server_options``), not the test harness's default h11; one
test runs the ``serve`` process itself. Raw sockets pace bytes where the test
is about timing; everything else is polled against deadlines.
"""

from __future__ import annotations

import asyncio
import json
import select
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest

from sidecar.config import Config
from sidecar.params import MAX_BLOCK_IDS
from sidecar.sim.decode.config import DecodeSimConfig
from sidecar.sim.servers import ServerThread, serve
from tests.support.runner import (
    BODY_TIMEOUT,
    HEADER_TIMEOUT,
    MAX_HEADER,
    RETRIED,
    SHIPPED,
    Sidecar,
    guarded_sidecar,
    sidecar_process,
)
from tests.support.runner import kv_params as params
from tests.support.until import until

DECODE = DecodeSimConfig(port=0, max_model_len=50)  # D for this module (the ``decode`` fixture)

SLACK = 1.5  # how late past a timer the cut may come on a loaded machine


@pytest.fixture
def sidecar(decode: ServerThread) -> Iterator[Sidecar]:
    with guarded_sidecar(decode.url) as sc:
        yield sc


def chat(text: str, rid: str, **changes: Any) -> dict[str, Any]:
    """A chat request D rejects (400, prompt too long) unless ``text`` is short."""
    return {
        "model": "sim-model",
        "messages": [{"role": "user", "content": text}],
        "max_tokens": 4,
        "kv_transfer_params": params(rid, **changes),
    }


TOO_LONG = "word " * 80
HELD_BODY_TIMEOUT = 10.0


def seen_by_d(decode: ServerThread, request_id: str) -> bool:
    return any(entry["request_id"] == request_id for entry in httpx.get(decode.url + "/sim/log").json())


# --- raw HTTP/1.1 -----------------------------------------------------------------------------


@dataclass
class Answer:
    """What came back on a raw connection: a response (status 0 if none), then EOF or not."""

    status: int
    headers: dict[str, str]
    body: bytes
    closed: bool
    at: float  # monotonic time the answer (or the close) arrived

    def error(self) -> dict[str, Any]:
        error: dict[str, Any] = json.loads(self.body)["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["code"] == self.status
        return error


Dial = Callable[[str], socket.socket]


@pytest.fixture
def dial() -> Iterator[Dial]:
    """Open raw connections to a URL's host and port; all are closed after the test."""
    opened: list[socket.socket] = []

    def connect(url: str) -> socket.socket:
        parts = urlsplit(url)
        opened.append(socket.create_connection((parts.hostname, parts.port), timeout=10))
        return opened[-1]

    yield connect
    for sock in opened:
        sock.close()


def read_answer(sock: socket.socket, deadline: float, wait_close: bool = True) -> Answer:
    """Read one response (by content-length) and, with ``wait_close``, whether the server then closes."""
    data, at, closed = b"", 0.0, False
    while time.monotonic() < deadline:
        readable, _, _ = select.select([sock], [], [], max(0.0, deadline - time.monotonic()))
        if not readable:
            break
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            chunk = b""
        at = at or time.monotonic()
        if not chunk:
            closed = True
            break
        data += chunk
        if _complete(data):
            closed = wait_close and _closes(sock, deadline)
            break
    return _parse(data, closed, at)


def _complete(data: bytes) -> bool:
    _, sep, body = data.partition(b"\r\n\r\n")
    if not sep:
        return False
    length = _parse(data, False, 0.0).headers.get("content-length")
    return length is not None and len(body) >= int(length)


def _closes(sock: socket.socket, deadline: float) -> bool:
    readable, _, _ = select.select(
        [sock], [], [], max(0.0, min(deadline, time.monotonic() + 2) - time.monotonic())
    )
    if not readable:
        return False
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def _parse(data: bytes, closed: bool, at: float) -> Answer:
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    if not lines[0].startswith("HTTP/1.1 "):
        return Answer(0, {}, data, closed, at)
    headers = dict(line.split(": ", 1) for line in lines[1:] if ": " in line)
    return Answer(int(lines[0].split()[1]), {k.lower(): v for k, v in headers.items()}, body, closed, at)


def trickle(sock: socket.socket, data: bytes, every: float, stop: float) -> int:
    """Send ``data`` one byte per ``every`` seconds until the server answers or closes."""
    sent = 0
    for byte in data:
        if time.monotonic() > stop:
            break
        try:
            sock.send(bytes([byte]))
        except OSError:
            break
        sent += 1
        readable, _, _ = select.select([sock], [], [], every)  # paces the bytes; wakes on an answer
        if readable:
            break
    return sent


SLOW_HEAD = (
    b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
    + b"x-pad: "
    + (b"p" * 200)
)


# --- slow and endless header blocks -----------------------------------------------------------


def test_slowloris_is_cut_off(dial: Dial, sidecar: Sidecar) -> None:
    answers: list[tuple[float, Answer, int]] = []

    def slow_client() -> None:
        sock = dial(sidecar.url)
        started = time.monotonic()
        sent = trickle(sock, SLOW_HEAD, every=0.1, stop=started + HEADER_TIMEOUT + 5)
        answers.append((started, read_answer(sock, started + HEADER_TIMEOUT + 5), sent))
        sock.close()

    slow = [threading.Thread(target=slow_client) for _ in range(8)]
    for thread in slow:
        thread.start()
    for thread in slow:
        thread.join(HEADER_TIMEOUT + 10)
    assert len(answers) == 8
    for started, answer, sent in answers:
        assert answer.status == 408 and answer.closed
        assert answer.error()["type"] == "RequestTimeoutError"
        assert HEADER_TIMEOUT - 0.05 <= answer.at - started <= HEADER_TIMEOUT + SLACK
        assert sent < len(SLOW_HEAD)  # cut before the block could end
    sidecar.settle()
    assert sidecar.released() == []


def test_slow_header_blocks_do_not_block_other_clients(dial: Dial, decode: ServerThread) -> None:
    """Eight connections trickle their header blocks while ten requests are served. The header
    timeout is 30 s here: a sidecar held up by the trickling connections would answer the others
    only once it cut those, past the clients' 20 s timeout."""
    done, trickling = threading.Event(), threading.Barrier(9)  # eight slow clients and this test
    answered: list[socket.socket] = []

    def slow_client(sock: socket.socket) -> None:
        sock.send(SLOW_HEAD[:1])
        trickling.wait(10)
        for byte in SLOW_HEAD[1:]:
            if done.wait(0.1):
                return
            sock.send(bytes([byte]))
            if select.select([sock], [], [], 0)[0]:  # an answer (or a close) before the block ended
                answered.append(sock)
                return

    with guarded_sidecar(decode.url, client_header_timeout=30.0) as sc:
        slow = [threading.Thread(target=slow_client, args=(dial(sc.url),)) for _ in range(8)]
        for thread in slow:
            thread.start()
        trickling.wait(10)
        try:
            with httpx.Client(base_url=sc.url, timeout=20) as client:
                for i in range(10):
                    response = client.post("/v1/chat/completions", json=chat("hello", f"ok-{i}"))
                    assert response.status_code == 200
            assert all(thread.is_alive() for thread in slow) and answered == []  # still trickling
        finally:
            done.set()
            for thread in slow:
                thread.join(10)


def test_a_connection_that_never_sends_is_closed_quietly(dial: Dial, sidecar: Sidecar) -> None:
    sock = dial(sidecar.url)
    started = time.monotonic()
    answer = read_answer(sock, started + HEADER_TIMEOUT + SLACK + 1)
    assert (answer.status, answer.body, answer.closed) == (0, b"", True)
    assert HEADER_TIMEOUT - 0.05 <= answer.at - started <= HEADER_TIMEOUT + SLACK


def test_stray_line_ends_do_not_keep_a_connection_open(dial: Dial, sidecar: Sidecar) -> None:
    sock = dial(sidecar.url)
    started = time.monotonic()
    trickle(sock, b"\r\n" * 100, every=0.1, stop=started + HEADER_TIMEOUT + 5)
    answer = read_answer(sock, started + HEADER_TIMEOUT + 5)
    assert answer.status == 408 and answer.closed
    assert answer.at - started <= HEADER_TIMEOUT + SLACK


def test_idle_keep_alive_connection_is_closed(dial: Dial, sidecar: Sidecar) -> None:
    sock = dial(sidecar.url)
    sock.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
    first = read_answer(sock, time.monotonic() + 5, wait_close=False)
    assert first.status == 200 and first.headers.get("connection") != "close"
    assert _closes(sock, time.monotonic() + 3)
    assert 0.5 - 0.05 <= time.monotonic() - first.at <= 0.5 + SLACK


def test_header_block_over_the_limit_gets_431(dial: Dial, sidecar: Sidecar) -> None:
    pad = b"a" * (MAX_HEADER + 1)
    sock = dial(sidecar.url)
    sock.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\nx-request-id: big-head\r\nx-pad: " + pad + b"\r\n\r\n")
    answer = read_answer(sock, time.monotonic() + 5)
    assert answer.status == 431 and answer.closed
    assert answer.error()["type"] == "RequestHeaderFieldsTooLargeError"
    under = httpx.get(sidecar.url + "/health", headers={"x-pad": "a" * (MAX_HEADER - 200)})
    assert under.status_code == 200  # just under the limit: served


def test_many_small_headers_count_toward_the_limit(dial: Dial, sidecar: Sidecar) -> None:
    sock = dial(sidecar.url)
    headers = b"".join(b"x-%d: 1\r\n" % i for i in range(3000))  # ~25 KiB in 3000 headers
    sock.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n" + headers + b"\r\n")
    assert read_answer(sock, time.monotonic() + 5).status == 431


def test_an_endless_header_is_refused_long_before_it_ends(dial: Dial, sidecar: Sidecar) -> None:
    sock = dial(sidecar.url)
    sock.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\nx-pad: ")
    sent, budget = 0, 4 * 1024 * 1024
    while sent < budget:
        try:
            sock.sendall(b"a" * 8192)
        except OSError:  # the server closed first
            break
        sent += 8192
        readable, _, _ = select.select([sock], [], [], 0.005)
        if readable:
            break
    assert sent < budget  # the server did not buffer a 4 MiB header
    answer = read_answer(sock, time.monotonic() + 5)
    assert answer.closed and answer.status in (431, 0)  # 431, unless a reset ate it


def read_until_closed(sock: socket.socket, deadline: float) -> bytes:
    data = b""
    while time.monotonic() < deadline:
        readable, _, _ = select.select([sock], [], [], max(0.0, deadline - time.monotonic()))
        chunk = sock.recv(65536) if readable else b""
        if not chunk:
            break
        data += chunk
    return data


def completion(text: str, request_id: str) -> bytes:
    body = json.dumps({"model": "sim-model", "prompt": text, "max_tokens": 2}).encode()
    return body_head(len(body), request_id).replace(b"/v1/chat/completions", b"/v1/completions") + body


def test_pipelined_requests_are_all_answered(dial: Dial, sidecar: Sidecar) -> None:
    sock = dial(sidecar.url)
    sock.sendall(
        completion("hi", "pipe-1") + completion("hi", "pipe-2") + b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n"
    )
    data = read_until_closed(sock, time.monotonic() + 3)  # closed by the keep-alive timer
    assert data.count(b"HTTP/1.1 200 ") == 3
    assert data.index(b"pipe-1") < data.index(b"pipe-2")


def test_a_stalled_pipelined_head_waits_for_the_answer_before_it(
    dial: Dial, sidecar: Sidecar, decode: ServerThread
) -> None:
    """The header clock of a pipelined request never cuts the answer still due on the connection."""
    sock = dial(sidecar.url)
    started = time.monotonic()
    sock.sendall(completion("hi [[slow-headers:1.5]]", "pipe-slow") + b"GET /heal")
    data = read_until_closed(sock, started + 1.5 + HEADER_TIMEOUT + SLACK + 1)
    first, _, rest = data.partition(b"HTTP/1.1 408 ")
    assert first.startswith(b"HTTP/1.1 200 ") and b"pipe-slow" in first
    assert rest and b"RequestTimeoutError" in rest
    assert 1.5 <= time.monotonic() - started <= 1.5 + HEADER_TIMEOUT + SLACK  # deferred past the answer


def test_control_characters_in_a_header_get_a_vllm_shaped_400(dial: Dial, sidecar: Sidecar) -> None:
    sock = dial(sidecar.url)
    sock.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\nx-bad: a\x00b\r\n\r\n")
    answer = read_answer(sock, time.monotonic() + 5)
    assert (answer.status, answer.closed) == (400, True)
    error = answer.error()
    assert error["type"] == "BadRequestError" and error["message"].startswith("invalid HTTP request: ")


# --- slow and oversized bodies ----------------------------------------------------------------


def body_head(length: int, request_id: str) -> bytes:
    return (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        + b"x-request-id: %s\r\ncontent-length: %d\r\n\r\n" % (request_id.encode(), length)
    )


def test_a_stalled_body_gets_408_and_is_not_forwarded(
    dial: Dial, sidecar: Sidecar, decode: ServerThread
) -> None:
    body = json.dumps(chat("hello", "stall-1")).encode()
    sock = dial(sidecar.url)
    sock.sendall(body_head(len(body), "stall-1") + body[:20])
    stalled = time.monotonic()
    answer = read_answer(sock, stalled + BODY_TIMEOUT + SLACK + 1)
    assert answer.status == 408 and answer.closed
    assert answer.error()["type"] == "RequestTimeoutError"
    assert BODY_TIMEOUT - 0.05 <= answer.at - stalled <= BODY_TIMEOUT + SLACK
    assert not seen_by_d(decode, "stall-1")
    sidecar.settle()
    assert sidecar.released() == []
    assert sidecar.sample("kvr_requests_total", route="chat", status_class="client_gone") == 1


def test_a_slow_but_steady_body_is_served(dial: Dial, sidecar: Sidecar) -> None:
    """The body timer bounds the gap between reads, not the whole body."""
    body = json.dumps(chat("hello", "steady-1")).encode()
    pieces = [body[i : i + len(body) // 5 + 1] for i in range(0, len(body), len(body) // 5 + 1)]
    sock = dial(sidecar.url)
    sock.sendall(body_head(len(body), "steady-1"))
    started = time.monotonic()
    for piece in pieces:  # one piece every 0.4 s: more than BODY_TIMEOUT in all
        readable, _, _ = select.select([sock], [], [], 0.4)
        assert not readable, "the server answered before the body was complete"
        sock.sendall(piece)
    answer = read_answer(sock, time.monotonic() + 5, wait_close=False)
    assert time.monotonic() - started > BODY_TIMEOUT
    assert answer.status == 200


class SlowReader:
    """A D that waits before reading a request body (passthrough routes stream bodies to D)."""

    def __init__(self, wait: float) -> None:
        self.wait = wait

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        await asyncio.sleep(self.wait)
        size, more = 0, True
        while more:
            message = await receive()
            size += len(message.get("body", b""))
            more = message.get("more_body", False)
        body = str(size).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-length", b"%d" % len(body))],
            }
        )
        await send({"type": "http.response.body", "body": body})


def test_a_body_held_back_by_a_slow_d_is_not_cut(dial: Dial) -> None:
    """Flow control stops reading from the client while D is slow: that gap is not the client's."""
    size = 64 * 1024 * 1024  # more than every socket buffer on the way, so reading must pause
    with serve(SlowReader(wait=BODY_TIMEOUT + 1.0)) as slow_d, guarded_sidecar(slow_d.url) as sc:
        sock = dial(sc.url)
        sock.sendall(b"POST /v1/files HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n" % size)
        chunk, sent = b"x" * (1024 * 1024), 0
        while sent < size:
            sock.sendall(chunk)  # blocks while the sidecar holds reading back
            sent += len(chunk)
        answer = read_answer(sock, time.monotonic() + 30, wait_close=False)
        assert (answer.status, answer.body) == (200, str(size).encode())


def test_body_over_the_cap_gets_vllm_shaped_413_and_releases(decode: ServerThread) -> None:
    with guarded_sidecar(decode.url, max_body_bytes=4096) as sc:
        body = {"model": "sim-model", "prompt": "x " * 4000, "kv_transfer_params": params("cap-1")}
        response = httpx.post(sc.url + "/v1/completions", json=body, headers={"x-request-id": "cap-1"})
        assert response.status_code == 413
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert (error["type"], error["code"]) == ("RequestEntityTooLargeError", 413)
        sent = len(response.request.content)
        assert error["message"] == f"request body of {sent} bytes exceeds the limit of 4096"
        assert sc.wait_released(1) == ["cap-1"] and sc.releaser.recorded[0].cause == "body_too_large"
        assert not seen_by_d(decode, "cap-1")


def test_a_body_far_over_the_cap_is_answered_without_reading_it_all(dial: Dial, decode: ServerThread) -> None:
    with guarded_sidecar(decode.url, max_body_bytes=4096) as sc:
        total, sent = 8 * 1024 * 1024, 0
        sock = dial(sc.url)
        sock.sendall(body_head(total, "huge-1") + b'{"prompt": "')
        while sent < total:
            sock.sendall(b"x" * 4096)
            sent += 4096
            readable, _, _ = select.select([sock], [], [], 0.001)
            if readable:
                break
        answer = read_answer(sock, time.monotonic() + 5)
        assert answer.status == 413 and sent < total  # past 4 x the cap the sidecar stops reading
        # The message names the size the client declared, not the part of it the sidecar read.
        message = json.loads(answer.body)["error"]["message"]
        assert message == f"request body of {total} bytes exceeds the limit of 4096"
        # ... and sheds the connection instead of reading the unbounded rest outside the limits
        assert answer.headers.get("connection") == "close" and answer.closed
        sc.settle()
        assert sc.released() == []  # the tail never arrived: no trustworthy parameters
        assert not seen_by_d(decode, "huge-1")


def test_a_chunked_body_far_over_the_cap_is_named_by_what_was_read(dial: Dial, decode: ServerThread) -> None:
    """No size declared: the message gives what was read, as a lower bound when reading stopped."""
    with guarded_sidecar(decode.url, max_body_bytes=4096) as sc:
        sock = dial(sc.url)
        head = b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n"
        sock.sendall(head)
        chunk = b"1000\r\n" + b"x" * 4096 + b"\r\n"
        for _ in range(64):  # 256 KiB, past 4 x the cap: the sidecar stops reading
            sock.sendall(chunk)
            readable, _, _ = select.select([sock], [], [], 0.001)
            if readable:
                break
        answer = read_answer(sock, time.monotonic() + 5)
        message = json.loads(answer.body)["error"]["message"]
        assert answer.status == 413 and message.startswith("request body of more than ")
        read = int(message.split()[5])
        assert 4 * 4096 < read <= 64 * 4096 and message.endswith(" bytes exceeds the limit of 4096")


# --- bodies D must judge ----------------------------------------------------------------------


def post_raw(sidecar: Sidecar, body: bytes, request_id: str) -> httpx.Response:
    return httpx.post(
        sidecar.url + "/v1/chat/completions",
        content=body,
        headers={"content-type": "application/json", "x-request-id": request_id},
        timeout=30,
    )


def test_invalid_utf8_in_the_parameters_is_malformed_and_forwarded(
    sidecar: Sidecar, decode: ServerThread
) -> None:
    body = json.dumps(chat("hello", "u8-params")).encode().replace(b'"p-engine"', b'"p-\xff\xfe"')
    response = post_raw(sidecar, body, "u8-params")
    assert response.status_code == 400 and response.json()["error"]["code"] == 400
    assert seen_by_d(decode, "u8-params")
    sidecar.settle()
    assert sidecar.released() == []
    assert sidecar.sample("kvr_ineligible_total", reason="malformed") == 1


def test_invalid_utf8_in_a_field_the_view_reads_is_forwarded_unread(
    sidecar: Sidecar, decode: ServerThread
) -> None:
    body = json.dumps({**chat("hello", "u8-stream"), "stream": "x"}).encode().replace(b'"x"', b'"\xff"')
    response = post_raw(sidecar, body, "u8-stream")
    assert response.status_code == 400
    assert seen_by_d(decode, "u8-stream")
    sidecar.settle()
    assert sidecar.released() == []
    assert sidecar.sample("kvr_ineligible_total", reason="not_json") == 1


def test_invalid_utf8_in_the_prompt_is_d_rejecting_a_releasable_request(
    sidecar: Sidecar, decode: ServerThread
) -> None:
    """D refuses the body before admission (400): P's blocks are freed, as for any 4xx."""
    body = json.dumps(chat("hello", "u8-prompt")).encode().replace(b'"hello"', b'"hel\xfflo"')
    response = post_raw(sidecar, body, "u8-prompt")
    assert response.status_code == 400
    assert seen_by_d(decode, "u8-prompt")
    assert sidecar.wait_released(1) == ["u8-prompt"]
    assert sidecar.releaser.recorded[0].cause == "rejected_4xx"


def deep_body(depth: int, rid: str) -> bytes:
    return json.dumps(chat("hello", rid)).encode()[:-1] + b', "tools": ' + b"[" * depth + b"]" * depth + b"}"


def test_deep_nesting_is_answered_and_the_sidecar_carries_on(sidecar: Sidecar) -> None:
    response = post_raw(sidecar, deep_body(10_000, "deep-1"), "deep-1")
    # Forwarded unread (too deep to decode): D's own answer, a 400 from its JSON decoder.
    assert response.status_code == 400 and response.json()["error"]["code"] == 400
    sidecar.settle()
    assert sidecar.released() == []
    assert (
        post_raw(sidecar, json.dumps(chat("hello", "after-deep")).encode(), "after-deep").status_code == 200
    )


def test_deep_nesting_is_forwarded_to_d(sidecar: Sidecar, decode: ServerThread) -> None:
    response = post_raw(sidecar, deep_body(10_000, "deep-2"), "deep-2")
    assert response.headers.get("x-request-id") == "deep-2"
    assert sidecar.sample("kvr_ineligible_total", reason="not_json") == 1


def test_one_block_id_past_the_cap_is_refused_within_bounds(sidecar: Sidecar, decode: ServerThread) -> None:
    """Over MAX_BLOCK_IDS: malformed, never released, and the request is still answered quickly."""
    blocks = list(range(MAX_BLOCK_IDS + 1))
    body = json.dumps(chat(TOO_LONG, "past-cap", remote_block_ids=blocks)).encode()
    assert len(body) < Config().max_body_bytes  # the body cap lets it through: the id cap refuses it
    started = time.monotonic()
    response = post_raw(sidecar, body, "past-cap")
    assert response.status_code == 400
    assert time.monotonic() - started < 15.0
    sidecar.settle()
    assert sidecar.released() == []
    assert sidecar.sample("kvr_ineligible_total", reason="malformed") == 1


def test_the_largest_allowed_block_list_is_released_intact(sidecar: Sidecar, decode: ServerThread) -> None:
    blocks = list(range(MAX_BLOCK_IDS))
    response = post_raw(sidecar, json.dumps(chat(TOO_LONG, "max", remote_block_ids=blocks)).encode(), "max")
    assert response.status_code == 400
    assert sidecar.wait_released(1, timeout=15.0) == ["max"]
    assert sidecar.releaser.recorded[0].params.blocks == len(blocks)  # counted, never held as a list


MALFORMED = [
    ("port -1", {"remote_port": -1}),
    ("port 0", {"remote_port": 0}),
    ("port 70000", {"remote_port": 70000}),
    ("tp_size 0", {"tp_size": 0}),
    ("tp_size 10^9", {"tp_size": 10**9}),
    ("pp_size 0", {"pp_size": 0}),
    ("empty engine id", {"remote_engine_id": ""}),
    ("engine id too long", {"remote_engine_id": "e" * 513}),
    ("bool block id", {"remote_block_ids": [[True]]}),
]


@pytest.mark.parametrize(("name", "changes"), MALFORMED, ids=[m[0] for m in MALFORMED])
def test_malformed_parameters_are_counted_forwarded_and_never_released(
    sidecar: Sidecar, decode: ServerThread, name: str, changes: dict[str, Any]
) -> None:
    rid = "mal-" + name.replace(" ", "-")
    response = post_raw(sidecar, json.dumps(chat(TOO_LONG, rid, **changes)).encode(), rid)
    assert response.status_code == 400  # D's own rejection (prompt too long)
    assert seen_by_d(decode, rid)
    sidecar.settle()
    assert sidecar.released() == []
    assert sidecar.sample("kvr_ineligible_total", reason="malformed") == 1


@pytest.mark.parametrize("ascii_only", [True, False], ids=["escaped", "utf8"])
def test_ids_with_colons_and_non_ascii_are_released_intact(sidecar: Sidecar, ascii_only: bool) -> None:
    engine, rid = "eng:1:ü", f"req:ä:漢字:{ascii_only}"
    body = json.dumps(chat(TOO_LONG, rid, remote_engine_id=engine), ensure_ascii=ascii_only).encode()
    assert post_raw(sidecar, body, "colon-1").status_code == 400
    assert sidecar.wait_released(1) == [rid]
    job = sidecar.releaser.recorded[0]
    assert (job.params.remote_engine_id, job.params.remote_request_id) == (engine, rid)


# --- concurrency ------------------------------------------------------------------------------


@RETRIED
def test_over_the_concurrency_limit_answers_vllm_shaped_503(decode: ServerThread, retried: object) -> None:
    with guarded_sidecar(decode.url, limit_concurrency=2, retried_statuses=retried) as sc:
        held: list[int] = []

        def hold(i: int) -> None:
            body = chat("hi [[slow-headers:1.5]]", f"held-{i}")
            held.append(httpx.post(sc.url + "/v1/chat/completions", json=body, timeout=10).status_code)

        threads = [threading.Thread(target=hold, args=(i,)) for i in range(2)]
        for thread in threads:
            thread.start()
        until(lambda: sc.sample("kvr_inflight_requests") >= 2, "both requests in flight", 5.0, 0.005)
        assert sc.sample("kvr_inflight_requests") == 2
        response = httpx.post(
            sc.url + "/v1/chat/completions", json=chat(TOO_LONG, "over"), headers={"x-request-id": "over"}
        )
        assert response.status_code == 503 and response.headers["connection"] == "close"
        assert response.json()["error"] == {
            "message": "the sidecar is at its concurrency limit",
            "type": "ServiceUnavailableError",
            "param": None,
            "code": 503,
        }
        for thread in threads:
            thread.join(10)
        assert held == [200, 200]
        assert not seen_by_d(decode, "over")
        if retried == SHIPPED:  # a proxy in front may resend the 503 to another pod, whose D reads
            sc.settle()  # them: refused unread, nothing to release
            assert sc.released() == []
            assert sc.sample("kvr_rejections_total", cause="overloaded") == 0
        else:  # a rejection before D like any other: the body was read and P's blocks are released
            assert sc.wait_released(1) == ["over"] and sc.releaser.recorded[0].cause == "overloaded"
            assert sc.sample("kvr_rejections_total", cause="overloaded") == 1
        assert httpx.post(sc.url + "/v1/chat/completions", json=chat("hi", "after")).status_code == 200


def test_over_the_limit_bodies_are_read_up_to_a_cap_then_refused_unread(
    dial: Dial, decode: ServerThread
) -> None:
    """Above the limit at most 8 bodies are read at once (to release what they name); the next
    over-limit request is refused at once, unread, and not released; passthrough too."""
    # The read slots hold half-sent bodies: the body timeout (10 s here) would cut them and free the
    # slots, so a refusal that waited in line would come only after it.
    with guarded_sidecar(decode.url, limit_concurrency=1, client_body_timeout=HELD_BODY_TIMEOUT) as sc:
        holder = dial(sc.url)
        # Holds the one slot throughout: D answers it after 60 s, far past the rest of the test.
        held = json.dumps(chat("hi [[slow-headers:60]]", "held")).encode()
        holder.sendall(body_head(len(held), "held") + held)
        until(lambda: sc.sample("kvr_inflight_requests") >= 1, "the slot held", 5.0, 0.005, fail=False)
        stalled = [json.dumps(chat(TOO_LONG, f"slot-{i}")).encode() for i in range(8)]
        readers = [dial(sc.url) for _ in range(8)]
        for i, sock in enumerate(readers):  # each sends half its body and waits: a read slot held
            sock.sendall(body_head(len(stalled[i]), f"slot-{i}") + stalled[i][: len(stalled[i]) // 2])
        until(lambda: sc.sample("kvr_inflight_requests") >= 9, "the read slots held", 5.0, 0.005, fail=False)
        assert sc.sample("kvr_inflight_requests") == 9
        started = time.monotonic()
        body = json.dumps(chat(TOO_LONG, "unread")).encode()
        refused = post_raw(sc, body, "unread")
        assert refused.status_code == 503 and refused.headers["connection"] == "close"
        assert time.monotonic() - started < HELD_BODY_TIMEOUT / 2  # not queued behind the slots
        assert httpx.get(sc.url + "/health").status_code == 503  # passthrough: refused too
        for i, sock in enumerate(readers):  # the read slots complete their bodies: released
            sock.sendall(stalled[i][len(stalled[i]) // 2 :])
            answer = read_answer(sock, time.monotonic() + 5)
            assert answer.status == 503 and answer.closed
        assert sorted(sc.wait_released(8)) == sorted(f"slot-{i}" for i in range(8))
        sc.settle()
        assert "unread" not in sc.released()
        assert not seen_by_d(decode, "unread") and not any(seen_by_d(decode, f"slot-{i}") for i in range(8))
        assert sc.sample("kvr_inflight_requests") == 1  # the held request, still at D
        holder.close()  # its client leaves: the sidecar stops without waiting for D's answer


# --- the serve process itself -----------------------------------------------------------------


def test_the_serve_process_enforces_its_limits(dial: Dial, decode: ServerThread) -> None:
    flags = ("--client-header-timeout", "1", "--max-header-bytes", "4096", "--release", "off")
    with sidecar_process(decode.url, *flags) as (_, url, _):
        sock = dial(url)
        started = time.monotonic()
        trickle(sock, SLOW_HEAD, every=0.1, stop=started + 6)
        slow = read_answer(sock, started + 6)
        assert slow.status == 408 and slow.at - started <= 1.0 + SLACK
        sock = dial(url)
        sock.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\nx-pad: " + b"a" * 5000 + b"\r\n\r\n")
        assert read_answer(sock, time.monotonic() + 5).status == 431
        assert httpx.get(url + "/health").status_code == 200
