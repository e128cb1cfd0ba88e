"""``sidecar.upstream.framing.encode_head``: what D receives as the request head, as a table."""

from __future__ import annotations

import pytest

from sidecar.upstream.framing import encode_head

CASES = [
    (
        "bytes body: content-length from the body, the caller's dropped",
        ("POST", "/v1/completions", [("content-length", "999"), ("x-a", "1")], 2),
        (b"POST /v1/completions HTTP/1.1\r\nhost: d:8200\r\nx-a: 1\r\ncontent-length: 2\r\n\r\n", 2, False),
    ),
    (
        "no body on GET: no framing header",
        ("GET", "/health", [("transfer-encoding", "chunked")], 0),
        (b"GET /health HTTP/1.1\r\nhost: d:8200\r\n\r\n", 0, False),
    ),
    (
        "no body on POST: content-length 0",
        ("POST", "/x", [], 0),
        (b"POST /x HTTP/1.1\r\nhost: d:8200\r\ncontent-length: 0\r\n\r\n", 0, False),
    ),
    (
        "stream without content-length: chunked",
        ("POST", "/x", [("transfer-encoding", "gzip, chunked")], None),
        (b"POST /x HTTP/1.1\r\nhost: d:8200\r\ntransfer-encoding: chunked\r\n\r\n", None, False),
    ),
    (
        "stream with the caller's content-length: kept",
        ("PUT", "/x", [("Content-Length", "7")], None),
        (b"PUT /x HTTP/1.1\r\nhost: d:8200\r\ncontent-length: 7\r\n\r\n", 7, False),
    ),
    (
        "the caller's host is replaced, connection: close noticed",
        ("GET", "/", [("Host", "client"), ("connection", "Close")], 0),
        (b"GET / HTTP/1.1\r\nhost: d:8200\r\nconnection: Close\r\n\r\n", 0, True),
    ),
]


@pytest.mark.parametrize(("args", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_encode_head(args: tuple[str, str, list[tuple[str, str]], int | None], expected: object) -> None:
    method, target, headers, length = args
    assert encode_head(method, target, "d:8200", headers, length) == expected


@pytest.mark.parametrize("value", ["a\r\nx-injected: 1", "a\nb", "a\rb"])
def test_cr_or_lf_in_a_header_is_refused(value: str) -> None:
    with pytest.raises(ValueError, match="CR or LF"):
        encode_head("GET", "/", "d", [("x-a", value)], 0)
