"""Header hygiene between the client and D.

Hop-by-hop headers (RFC 9110 section 7.6.1, plus any named in
``Connection``) describe one connection and are stripped in both
directions. ``Host`` is set by the client library for D. Everything else,
``content-encoding`` included, passes through unchanged.
"""

from __future__ import annotations

import os

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


_REQUEST_DROP = HOP_BY_HOP | {b"host"}


def _named_in_connection(value: bytes) -> set[bytes]:
    return {token.strip().lower() for token in value.split(b",")}


_IDS_PER_READ = 256


class _RandomIds:
    """Request ids of 32 hex digits (128 bits), as ``os.urandom(16).hex()`` makes them, from the
    OS's random source read 256 ids at a time rather than one system call per id. Unique
    across processes and restarts like any id drawn from it; a forked child drops what its
    parent had read, so the two never hand out the same ids."""

    __slots__ = ("_at", "_digits")

    def __init__(self) -> None:
        self._digits = ""
        self._at = 0

    def take(self) -> str:
        at = self._at
        if at >= len(self._digits):
            self._digits, at = os.urandom(16 * _IDS_PER_READ).hex(), 0
        self._at = at + 32
        return self._digits[at : at + 32]

    def forget(self) -> None:
        self._digits, self._at = "", 0


_ids = _RandomIds()
os.register_at_fork(after_in_child=_ids.forget)
new_request_id = _ids.take


def request_headers(raw: list[tuple[bytes, bytes]]) -> tuple[list[tuple[str, str]], str, bool]:
    """Headers to send to D, the request id (propagated, or generated and added), and whether
    it was generated here (then no other server, P included, knows it).

    Names arrive lower-cased from the ASGI server (the ASGI spec requires it).
    """
    drop = _REQUEST_DROP
    out: list[tuple[str, str]] = []
    request_id = ""
    for name, value in raw:
        if name in drop:
            if name == b"connection":
                # Never x-request-id: D (and, through the router, P) must see the id kept here.
                drop = drop | (_named_in_connection(value) - {REQUEST_ID})
            continue
        if name == REQUEST_ID and not request_id:
            request_id = value.decode("latin-1")
        out.append((name.decode("latin-1"), value.decode("latin-1")))
    if drop is not _REQUEST_DROP:  # a Connection header named more hop-by-hop headers
        out = [(n, v) for n, v in out if n.encode("latin-1") not in drop]
    if not request_id:
        request_id = new_request_id()
        out.append(("x-request-id", request_id))
        return out, request_id, True
    return out, request_id, False


def response_headers(raw: list[tuple[bytes, bytes]], request_id: str) -> list[tuple[bytes, bytes]]:
    """D's response headers for the client, with ``x-request-id`` always present."""
    return response_head(raw, request_id)[0]


_EVENT_STREAM = b"text/event-stream"


def response_head(
    raw: list[tuple[bytes, bytes]], request_id: str
) -> tuple[list[tuple[bytes, bytes]], bool, bool]:
    """``response_headers``, and in the same pass over D's headers: whether they say
    ``Connection: close`` (``sidecar.decode.probes.says_close``), and whether the headers for the
    client name ``text/event-stream`` as the content type."""
    drop = HOP_BY_HOP
    out: list[tuple[bytes, bytes]] = []
    has_id = closing = events = False
    for name, value in raw:
        lower = name.lower()
        if lower in drop:
            if lower == b"connection":
                named = _named_in_connection(value)
                closing = closing or b"close" in named
                drop = drop | (named - {REQUEST_ID})  # the client always gets it
            continue
        if lower == REQUEST_ID:
            has_id = True
        elif lower == b"content-type" and not events:
            events = value.split(b";", 1)[0].strip().lower() == _EVENT_STREAM
        out.append((lower, value))
    if drop is not HOP_BY_HOP:
        out = [(n, v) for n, v in out if n not in drop]
        events = any(
            n == b"content-type" and v.split(b";", 1)[0].strip().lower() == _EVENT_STREAM for n, v in out
        )
    if not has_id:
        out.append((REQUEST_ID, request_id.encode("latin-1")))
    return out, closing, events


DATA_PARALLEL_RANK = b"x-data-parallel-rank"
_MAX_DP_RANK = 1 << 16  # far above any data-parallel size; bounds the int() parse


def data_parallel_rank(raw: list[tuple[bytes, bytes]]) -> int | None:
    """The request's ``X-data-parallel-rank`` (vLLM's DP routing header), when a plain rank."""
    for name, value in raw:
        if name.lower() == DATA_PARALLEL_RANK:
            text = value.strip()
            if text.isdigit() and len(text) <= 5 and int(text) < _MAX_DP_RANK:
                return int(text)
            return None  # vLLM answers a bad value itself; the release goes to its default rank
    return None
