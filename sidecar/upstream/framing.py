"""HTTP/1.1 message framing for the client to D: the request head it writes, and how D's
response body ends.

Framing headers (``content-length``, ``transfer-encoding``) and ``host`` in
the request head are always the sidecar's own, so the head D reads frames
exactly the body that follows; a CR or LF inside a header name or value
(request smuggling) is refused before anything is written.
"""

from __future__ import annotations

_FRAMING = frozenset({"content-length", "transfer-encoding", "host"})
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})


def encode_head(
    method: str, target: str, authority: str, headers: list[tuple[str, str]], length: int | None
) -> tuple[bytes, int | None, bool]:
    """The request head; the body's declared length (None: chunked); whether it says ``Connection: close``.

    ``length`` is the size of a bytes body, or None for a streamed one: a
    streamed body keeps the caller's ``content-length`` if there is one and is
    sent chunked otherwise. Framing headers and ``host`` are always ours.
    """
    lines = [f"{method} {target} HTTP/1.1\r\n", f"host: {authority}\r\n"]
    close = False
    for name, value in headers:
        lower = name.lower()
        if lower in _FRAMING:
            if length is None and lower == "content-length":
                length = int(value)
            continue
        if lower == "connection" and "close" in value.lower():
            close = True
        lines.append(f"{name}: {value}\r\n")
    if length is not None:
        if length or method in _BODY_METHODS:
            lines.append(f"content-length: {length}\r\n")
    else:
        lines.append("transfer-encoding: chunked\r\n")
    lines.append("\r\n")
    text = "".join(lines)
    # Each line carries exactly one CR LF: any other CR or LF came in a header (request smuggling).
    if text.count("\n") != len(lines) or text.count("\r") != len(lines):
        raise ValueError("CR or LF inside a request header")
    return text.encode("latin-1"), length, close


def body_ends_at_eof(headers: list[tuple[bytes, bytes]]) -> bool:
    """Neither content-length nor chunked: the body runs until D closes (RFC 9112 6.3).

    llhttp knows this but httptools does not expose it (nor ``llhttp_finish``),
    so the two framing headers llhttp already validated are looked up here.
    """
    codings = b""
    for name, value in headers:
        lower = name.lower()
        if lower == b"content-length":
            return False
        if lower == b"transfer-encoding":
            codings = value
    return not codings.lower().rstrip().endswith(b"chunked")
