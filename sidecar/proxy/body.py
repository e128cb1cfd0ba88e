"""Reading a request body once, under a cap, from an ASGI ``receive``.

An inspected body is read whole up to ``max_body_bytes`` (the original bytes
are forwarded untouched). Above the cap the sidecar answers 413, but P's
blocks were still pinned for this request, so the rest of the body is read
and discarded (bounded by ``scan_limit``) keeping only a tail window, where
routers append ``kv_transfer_params`` as the last key: ``tail_params`` finds
it there when it is the top-level object's last member.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from sidecar.asgi import Receive
from sidecar.exceptions import SidecarError

TAIL_WINDOW = 256 * 1024
_KEY = b'"kv_transfer_params"'


class ClientGone(SidecarError):
    """The client disconnected before its body was complete."""


@dataclass(slots=True)
class Oversized:
    """A body over the cap: its size seen so far and the kept tail."""

    size: int
    tail: bytes
    complete: bool  # the whole body was read (within scan_limit)


async def read_body(receive: Receive, cap: int, scan_limit: int) -> bytes | Oversized:
    """The whole body, or ``Oversized`` when it exceeds ``cap``. Raises ``ClientGone``."""
    parts: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        chunk: bytes = message.get("body", b"")
        size += len(chunk)
        more = message.get("more_body", False)
        if size > cap:
            return await _drain(receive, b"".join(parts) + chunk, size, more, scan_limit)
        if chunk:
            parts.append(chunk)
        if not more:
            return parts[0] if len(parts) == 1 else b"".join(parts)


async def _drain(receive: Receive, tail: bytes, size: int, more: bool, scan_limit: int) -> Oversized:
    tail = tail[-TAIL_WINDOW:]
    while more and size <= scan_limit:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        chunk = message.get("body", b"")
        size += len(chunk)
        tail = (tail + chunk)[-TAIL_WINDOW:]
        more = message.get("more_body", False)
    return Oversized(size=size, tail=tail, complete=not more)


def tail_params(tail: bytes) -> bytes | None:
    """Raw JSON (the bytes as sent) of a top-level, last-member ``kv_transfer_params`` in a body's tail.

    The member counts only when nothing but white space and the closing brace
    of the body follows its value, which makes it a member of the outermost
    object (a JSON string cannot contain the unescaped key).
    """
    index = tail.rfind(_KEY)
    if index <= 0:  # at 0 nothing shows it opens a key rather than ends a string
        return None
    backslashes = len(tail[:index]) - len(tail[:index].rstrip(b"\\"))
    if backslashes % 2:  # an escaped quote inside a string or key, not the key itself
        return None
    text = tail[index + len(_KEY) :].decode("utf-8", "surrogateescape")  # bad UTF-8: malformed, as in a body
    rest = text.lstrip()
    if not rest.startswith(":"):
        return None
    rest = rest[1:].lstrip()
    try:
        value, end = json.JSONDecoder().raw_decode(rest)
    except (ValueError, RecursionError):
        return None
    if rest[end:].strip() != "}" or not isinstance(value, dict):
        return None
    # The value's bytes exactly as sent (surrogateescape round-trips them): a router's HMAC
    # covers these bytes, so the trust check sees what the signer signed.
    return rest[:end].encode("utf-8", "surrogateescape")
