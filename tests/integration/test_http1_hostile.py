"""The sidecar's own HTTP/1.1 server against hostile input on real sockets, beside uvicorn and nginx.

Every input goes, as raw bytes on a fresh loopback connection, to three
servers in front of the same recording application: the sidecar's protocol
(``sidecar.server.protocol``, as ``serve`` runs it), uvicorn's httptools
protocol (``uvicorn --http httptools``), and Debian's nginx with the shipped
``deploy/mesh`` configuration. Each answer is the list of statuses written,
whether the connection then closed, and the requests the application saw
whole. The sidecar's must be the one in ``CASES``; where uvicorn's or nginx's
differ, ``DIFFERENT`` says how and why (docs/dev/architecture.md keeps the
table). Request smuggling (``Content-Length`` beside ``Transfer-Encoding``, two
lengths, obs-fold, a bare CR or LF, bad chunk sizes), pipelined requests, a
refusal behind an answer still owed, ``Connection: close`` followed by more,
protocol switches, and a half-closed socket. Slow and endless header blocks
(slowloris) and the timeouts are in ``test_hostile_input.py``.
"""

from __future__ import annotations

import asyncio
import re
import select
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from sidecar.server.host import server_options
from sidecar.server.limits import ServerLimits
from sidecar.sim.servers import serve
from tests.faults.fronts import front
from tests.support.until import until

LIMITS = ServerLimits(max_header_bytes=8 * 1024, keep_alive=0.5)


class Recorder:
    """An ASGI app that reads each body whole and answers 200 ``seen <path> <bytes>``; ``seen`` lists
    the requests it read whole, ``gone`` those whose client left (or whose body broke) first."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, int]] = []
        self.gone: list[str] = []

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        body = b""
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                self.gone.append(scope["path"])
                return
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        if scope["path"] == "/slow" and (await receive())["type"] == "http.disconnect":
            self.gone.append(scope["path"])  # it waited for the client to leave
            return
        self.seen.append((scope["path"], len(body)))
        out = b"seen %s %d" % (scope["path"].encode(), len(body))
        await send(
            {"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"%d" % len(out))]}
        )
        await send({"type": "http.response.body", "body": out})


@dataclass(frozen=True)
class Answer:
    statuses: tuple[int, ...]
    closed: bool
    seen: tuple[tuple[str, int], ...]


@dataclass
class Target:
    port: int
    app: Recorder

    def send(self, data: bytes, half_close: bool = False, within: float = 5.0, quiet: float = 1.0) -> Answer:
        """``data`` on a new connection; what came back until the server closed it, or stayed silent
        for ``quiet`` seconds (its keep-alive limit is longer), or ``within`` passed."""
        self.app.seen.clear()
        sock = socket.create_connection(("127.0.0.1", self.port), timeout=within)
        sock.sendall(data)
        if half_close:
            sock.shutdown(socket.SHUT_WR)
        received, closed, deadline = b"", False, time.monotonic() + within
        while time.monotonic() < deadline:
            wait = min(deadline - time.monotonic(), quiet)
            readable, _, _ = select.select([sock], [], [], max(0.0, wait))
            if not readable:
                break
            try:
                chunk = sock.recv(65536)
            except ConnectionResetError:
                chunk = b""
            if not chunk:
                closed = True
                break
            received += chunk
        sock.close()
        statuses = tuple(int(s) for s in re.findall(rb"HTTP/1\.[01] (\d{3}) ", received))
        return Answer(statuses, closed, tuple(self.app.seen))


@pytest.fixture(scope="module")
def targets() -> Iterator[dict[str, Target]]:
    apps = {name: Recorder() for name in ("sidecar", "uvicorn", "nginx")}
    quiet: dict[str, Any] = {"lifespan": "off", "log_level": "critical"}
    with (
        serve(apps["sidecar"], **quiet, **server_options(LIMITS)) as sidecar,
        serve(apps["uvicorn"], **quiet, http="httptools", timeout_keep_alive=0.5) as uvicorn,
        serve(apps["nginx"], **quiet) as behind_nginx,
    ):
        upstream = f"127.0.0.1:{behind_nginx.port}"
        with front("nginx", [upstream, upstream]) as nginx_url:
            yield {
                "sidecar": Target(sidecar.port, apps["sidecar"]),
                "uvicorn": Target(uvicorn.port, apps["uvicorn"]),
                "nginx": Target(int(nginx_url.rsplit(":", 1)[1]), apps["nginx"]),
            }


def request(head: bytes, body: bytes = b"") -> bytes:
    return head.replace(b"\n", b"\r\n") + b"\r\n" + body


GET1 = request(b"GET /1 HTTP/1.1\nhost: x\n")
GET2 = request(b"GET /2 HTTP/1.1\nhost: x\n")
REFUSED = Answer((400,), True, ())
H2C = b"connection: upgrade, http2-settings\nupgrade: h2c\nhttp2-settings: AAMAAABkAAQAoAAAAAIAAAAA\n"
# input -> the sidecar's answer: statuses, closed, requests the application read whole
CASES: dict[str, tuple[bytes, Answer]] = {
    "content-length and transfer-encoding": (
        request(b"POST /a HTTP/1.1\nhost: x\ncontent-length: 4\ntransfer-encoding: chunked\n", b"0\r\n\r\n")
        + request(b"GET /smuggled HTTP/1.1\nhost: x\n"),
        REFUSED,
    ),
    "transfer-encoding and content-length": (
        request(b"POST /a HTTP/1.1\nhost: x\ntransfer-encoding: chunked\ncontent-length: 5\n", b"0\r\n\r\nX"),
        REFUSED,
    ),
    "two content-lengths": (
        request(b"POST /a HTTP/1.1\nhost: x\ncontent-length: 4\ncontent-length: 5\n", b"abcde"),
        REFUSED,
    ),
    "the same content-length twice": (
        request(b"POST /a HTTP/1.1\nhost: x\ncontent-length: 4\ncontent-length: 4\n", b"abcd"),
        REFUSED,
    ),
    "a content-length list": (
        request(b"POST /a HTTP/1.1\nhost: x\ncontent-length: 4, 4\n", b"abcd"),
        REFUSED,
    ),
    "obs-fold": (request(b"GET /a HTTP/1.1\nhost: x\nx-a: b\n c\n"), REFUSED),
    "a bare CR in a header": (request(b"GET /a HTTP/1.1\nhost: x\nx-a: b\rc\n"), REFUSED),
    "bare LF line ends": (b"GET /a HTTP/1.1\nhost: x\n\n", REFUSED),
    "white space before the colon": (request(b"GET /a HTTP/1.1\nhost: x\nx-a : b\n"), REFUSED),
    "a NUL in a value": (request(b"GET /a HTTP/1.1\nhost: x\nx-a: b\x00c\n"), REFUSED),
    "a chunk size that is not hex": (
        request(b"POST /a HTTP/1.1\nhost: x\ntransfer-encoding: chunked\n", b"zz\r\nabc\r\n0\r\n\r\n"),
        REFUSED,
    ),
    "a chunk size past 64 bits": (
        request(
            b"POST /a HTTP/1.1\nhost: x\ntransfer-encoding: chunked\n", b"f" * 18 + b"\r\nabc\r\n0\r\n\r\n"
        ),
        REFUSED,
    ),
    "chunked not the last coding": (
        request(
            b"POST /a HTTP/1.1\nhost: x\ntransfer-encoding: chunked, identity\n", b"3\r\nabc\r\n0\r\n\r\n"
        ),
        REFUSED,
    ),
    "an unknown coding": (
        request(b"POST /a HTTP/1.1\nhost: x\ntransfer-encoding: xchunked\n", b"3\r\nabc\r\n0\r\n\r\n"),
        REFUSED,
    ),
    "three pipelined requests": (
        GET1 + GET2 + request(b"POST /3 HTTP/1.1\nhost: x\ncontent-length: 3\n", b"abc"),
        Answer((200, 200, 200), True, (("/1", 0), ("/2", 0), ("/3", 3))),  # closed: the keep-alive limit
    ),
    "a malformed request behind one answered": (
        GET1 + request(b"GET /2 HTTP/1.1\nhost: x\ncontent-length: 1\ncontent-length: 2\n") + GET2,
        Answer((200, 400), True, (("/1", 0),)),
    ),
    "a head over the limit behind one answered": (
        GET1 + request(b"GET /2 HTTP/1.1\nhost: x\nx-pad: " + b"p" * 9000 + b"\n") + GET2,
        Answer((200, 431), True, (("/1", 0),)),
    ),
    "connection close, then more": (
        request(b"GET /1 HTTP/1.1\nhost: x\nconnection: close\n") + GET2,
        Answer((200,), True, (("/1", 0),)),
    ),
    "HTTP/1.0": (request(b"GET /1 HTTP/1.0\nhost: x\n") + GET2, Answer((200,), True, (("/1", 0),))),
    "an upgrade to h2c": (
        request(b"GET /1 HTTP/1.1\nhost: x\n" + H2C) + GET2,
        Answer((200,), True, (("/1", 0),)),
    ),
    "an upgrade with a body": (
        request(
            b"POST /1 HTTP/1.1\nhost: x\nconnection: upgrade\nupgrade: websocket\ncontent-length: 3\n", b"abc"
        ),
        REFUSED,
    ),
    "CONNECT": (request(b"CONNECT example.com:443 HTTP/1.1\nhost: example.com:443\n"), REFUSED),
    "an unknown HTTP version": (request(b"GET /1 HTTP/2.7\nhost: x\n"), REFUSED),
    "no host": (request(b"GET /1 HTTP/1.1\n"), Answer((200,), True, (("/1", 0),))),
}
# Where uvicorn's or nginx's answer (its statuses and what it let through) is not the sidecar's, and why
# the sidecar's is kept.
DIFFERENT: dict[tuple[str, str], tuple[Answer, str]] = {
    ("uvicorn", "a malformed request behind one answered"): (
        Answer((400,), True, (("/1", 0),)),
        "uvicorn writes its 400 at once, before the answer owed to the first request, and closes",
    ),
    ("uvicorn", "a head over the limit behind one answered"): (
        Answer((200, 200, 200), True, (("/1", 0), ("/2", 0), ("/2", 0))),
        "uvicorn has no limit on a header block",
    ),
    ("nginx", "a head over the limit behind one answered"): (
        Answer((200, 400), True, (("/1", 0),)),
        "nginx answers 400 (Request Header Or Cookie Too Large); the sidecar 431, vLLM's shape",
    ),
    ("nginx", "bare LF line ends"): (
        Answer((200,), True, (("/a", 0),)),
        "nginx accepts a bare LF as a line end; llhttp refuses it (RFC 9112 allows either)",
    ),
    ("nginx", "chunked not the last coding"): (Answer((501,), True, ()), "nginx answers 501, llhttp 400"),
    ("nginx", "an unknown coding"): (Answer((501,), True, ()), "nginx answers 501, llhttp 400"),
    ("nginx", "an unknown HTTP version"): (Answer((505,), True, ()), "nginx answers 505, llhttp 400"),
    ("nginx", "an upgrade with a body"): (
        Answer((200,), True, (("/1", 3),)),
        "nginx forwards it with its body; llhttp stops at a switching request's head, so the sidecar "
        "refuses it rather than hand on an empty body",
    ),
    ("nginx", "an upgrade to h2c"): (
        Answer((200, 200), False, (("/1", 0), ("/2", 0))),
        "nginx ignores a switch it does not make and reads on; llhttp stops at that head, so the "
        "sidecar answers it and closes",
    ),
    ("nginx", "no host"): (
        REFUSED,
        "nginx enforces RFC 9112's Host; the sidecar, as uvicorn and vLLM behind it, does not route by Host",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_sidecar_answers_hostile_input_as_the_table_says_beside_uvicorn_and_nginx(
    targets: dict[str, Target], case: str
) -> None:
    data, expected = CASES[case]
    answers = {name: target.send(data) for name, target in targets.items()}
    assert answers["sidecar"] == expected
    for other in ("uvicorn", "nginx"):  # what each answered and let through; when it closes is its own
        known = DIFFERENT.get((other, case))
        theirs, ours = answers[other], known[0] if known else expected
        assert (theirs.statuses, theirs.seen) == (ours.statuses, ours.seen), (
            f"{other}: {known[1] if known else ''}"
        )


def test_a_refusal_never_hands_the_application_a_smuggled_request(targets: dict[str, Target]) -> None:
    """The first case's trailing ``GET /smuggled`` reaches no application through any server."""
    for target in targets.values():
        assert target.send(CASES["content-length and transfer-encoding"][0]).seen == ()


def test_a_half_closed_client_has_left_and_gets_no_answer(targets: dict[str, Target]) -> None:
    """A client that sends a whole request and shuts its sending side is gone, as nginx (499) and
    uvicorn take it: no answer, the connection closed, and a request waiting on the client sees
    the disconnect."""
    slow = request(b"POST /slow HTTP/1.1\nhost: x\ncontent-length: 2\n", b"ab")
    for name, target in targets.items():
        target.app.gone.clear()
        answer = target.send(slow, half_close=True)
        assert (answer.statuses, answer.closed, answer.seen) == ((), True, ()), name
        until(lambda t=target: "/slow" in t.app.gone, f"{name}'s app to see the client gone", 5.0, fail=False)
        assert target.app.gone == ["/slow"], name


def test_the_connection_stays_usable_after_each_pipelined_answer(targets: dict[str, Target]) -> None:
    sidecar = targets["sidecar"]
    sock = socket.create_connection(("127.0.0.1", sidecar.port), timeout=5)
    try:
        for i in range(3):  # one request at a time on one keep-alive connection
            sock.sendall(request(b"GET /k%d HTTP/1.1\nhost: x\n" % i))
            assert sock.recv(65536).startswith(b"HTTP/1.1 200 OK\r\n")
    finally:
        sock.close()


def test_the_event_loop_is_not_needed_by_the_table() -> None:
    # CASES and DIFFERENT name only cases that exist (a renamed case cannot leave a stale difference)
    assert {case for _, case in DIFFERENT} <= set(CASES)
    assert asyncio.iscoroutinefunction(Recorder.__call__)
