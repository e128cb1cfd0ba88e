"""Header hygiene between client and D."""

from __future__ import annotations

import os
import re
import warnings

import pytest

from sidecar.decode.probes import says_close
from sidecar.proxy.headers import (
    data_parallel_rank,
    new_request_id,
    request_headers,
    response_head,
    response_headers,
)


def test_request_strips_hop_by_hop_and_host_and_keeps_the_rest() -> None:
    raw = [
        (b"host", b"sidecar:8000"),
        (b"connection", b"keep-alive, x-private"),
        (b"keep-alive", b"timeout=5"),
        (b"x-private", b"secret-hop"),
        (b"transfer-encoding", b"chunked"),
        (b"te", b"trailers"),
        (b"upgrade", b"h2c"),
        (b"proxy-authorization", b"Basic x"),
        (b"authorization", b"Bearer k"),
        (b"content-type", b"application/json"),
        (b"content-encoding", b"gzip"),
        (b"x-request-id", b"abc"),
    ]
    headers, request_id, generated = request_headers(raw)
    names = [name for name, _ in headers]
    assert request_id == "abc" and not generated
    assert names == ["authorization", "content-type", "content-encoding", "x-request-id"]


def test_request_id_generated_when_missing() -> None:
    headers, request_id, generated = request_headers([(b"content-type", b"application/json")])
    assert len(request_id) == 32 and generated
    assert ("x-request-id", request_id) in headers
    _, other, _ = request_headers([])
    assert other != request_id
    # An empty header is no id: one is generated (vLLM would make up its own too).
    _, made, generated = request_headers([(b"x-request-id", b"")])
    assert made and generated


def test_made_up_request_ids_are_128_random_bits_never_repeated() -> None:
    ids = [new_request_id() for _ in range(3000)]  # across several reads of the random source
    assert all(re.fullmatch(r"[0-9a-f]{32}", made) for made in ids)
    assert len(set(ids)) == len(ids)
    ones = sum(bin(int(made, 16)).count("1") for made in ids)
    assert 0.48 < ones / (128 * len(ids)) < 0.52  # as many one bits as zero bits: random, not counted


def test_a_forked_child_makes_up_ids_of_its_own() -> None:
    new_request_id()  # the parent holds unread random bytes the child must not hand out again
    read, write = os.pipe()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # Python 3.12+ warns about forking with threads
        pid = os.fork()
    if pid == 0:  # the child
        os.close(read)
        os.write(write, "".join(new_request_id() for _ in range(10)).encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        child = pipe.read().decode()
    os.waitpid(pid, 0)
    parent = "".join(new_request_id() for _ in range(10))
    assert len(child) == len(parent) == 320 and child != parent
    assert not {child[i : i + 32] for i in range(0, 320, 32)} & {
        parent[i : i + 32] for i in range(0, 320, 32)
    }


def test_response_keeps_encoding_adds_request_id() -> None:
    raw = [
        (b"Content-Encoding", b"gzip"),
        (b"Transfer-Encoding", b"chunked"),
        (b"Connection", b"close"),
        (b"Content-Type", b"text/event-stream"),
    ]
    out = response_headers(raw, "rid")
    assert out == [
        (b"content-encoding", b"gzip"),
        (b"content-type", b"text/event-stream"),
        (b"x-request-id", b"rid"),
    ]


def test_response_keeps_ds_request_id() -> None:
    out = response_headers([(b"x-request-id", b"from-d")], "rid")
    assert out == [(b"x-request-id", b"from-d")]


@pytest.mark.parametrize(
    ("value", "rank"),
    [
        (b"0", 0),
        (b"3", 3),
        (b" 7 ", 7),
        (b"-1", None),
        (b"x", None),
        (b"", None),
        (b"99999999999999999999", None),
        (b"65536", None),
    ],
)
def test_data_parallel_rank(value: bytes, rank: int | None) -> None:
    assert data_parallel_rank([(b"x-other", b"1"), (b"X-Data-Parallel-Rank", value)]) == rank


def test_data_parallel_rank_absent() -> None:
    assert data_parallel_rank([(b"x-request-id", b"1")]) is None


def test_connection_cannot_strip_the_request_id() -> None:
    # The id kept for the release must be the one D sees (and P, through a router).
    raw = [(b"connection", b"x-request-id, x-private"), (b"x-private", b"p"), (b"x-request-id", b"abc")]
    headers, request_id, generated = request_headers(raw)
    assert (request_id, generated) == ("abc", False)
    assert headers == [("x-request-id", "abc")]


def test_response_keeps_the_request_id_whatever_connection_names() -> None:
    raw = [(b"Connection", b"x-request-id"), (b"X-Request-Id", b"from-d")]
    assert response_headers(raw, "rid") == [(b"x-request-id", b"from-d")]


@pytest.mark.parametrize(
    "raw",
    [
        [(b"Content-Type", b"text/event-stream; charset=utf-8"), (b"Connection", b"Keep-Alive, Close")],
        [(b"content-type", b"application/json"), (b"connection", b"keep-alive")],
        [(b"Content-Type", b" Text/Event-Stream ")],
        [(b"connection", b"content-type"), (b"content-type", b"text/event-stream")],
        [(b"content-type", b"text/event-streams"), (b"CONNECTION", b"close")],
        [],
    ],
)
def test_response_head_says_in_one_pass_what_the_separate_reads_say(raw: list[tuple[bytes, bytes]]) -> None:
    head, closing, events = response_head(raw, "rid")
    assert head == response_headers(raw, "rid")
    assert closing == says_close(raw)
    assert events == any(
        name == b"content-type" and value.split(b";", 1)[0].strip().lower() == b"text/event-stream"
        for name, value in head
    )
