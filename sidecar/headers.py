"""Header hygiene between the client and D.

Hop-by-hop headers (RFC 9110 section 7.6.1, plus any named in
``Connection``) describe one connection and are stripped in both
directions. ``Host`` is set by the client library for D. Everything else,
``content-encoding`` included, passes through unchanged.
"""

from __future__ import annotations

import uuid

HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"proxy-connection",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
    }
)
REQUEST_ID = b"x-request-id"


def _named_in_connection(headers: list[tuple[bytes, bytes]]) -> set[bytes]:
    named: set[bytes] = set()
    for name, value in headers:
        if name.lower() == b"connection":
            named.update(token.strip().lower() for token in value.split(b","))
    return named


def request_headers(raw: list[tuple[bytes, bytes]]) -> tuple[list[tuple[str, str]], str]:
    """Headers to send to D, and the request id (propagated, or generated and added).

    Names arrive lower-cased from the ASGI server.
    """
    drop = HOP_BY_HOP | _named_in_connection(raw) | {b"host"}
    out: list[tuple[str, str]] = []
    request_id = ""
    for name, value in raw:
        if name in drop:
            continue
        if name == REQUEST_ID and not request_id:
            request_id = value.decode("latin-1")
        out.append((name.decode("latin-1"), value.decode("latin-1")))
    if not request_id:
        request_id = uuid.uuid4().hex
        out.append(("x-request-id", request_id))
    return out, request_id


def response_headers(raw: list[tuple[bytes, bytes]], request_id: str) -> list[tuple[bytes, bytes]]:
    """D's response headers for the client, with ``x-request-id`` always present."""
    drop = HOP_BY_HOP | _named_in_connection(raw)
    out = [(name.lower(), value) for name, value in raw if name.lower() not in drop]
    if not any(name == REQUEST_ID for name, _ in out):
        out.append((REQUEST_ID, request_id.encode("latin-1")))
    return out
