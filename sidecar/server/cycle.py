"""One request's uvicorn ``RequestResponseCycle`` as ``sidecar.transport.relay`` uses it.

Part of the sidecar's touch points with uvicorn's internals, listed in
``sidecar.server.protocol`` and checked by ``tests/unit/test_uvicorn_internals.py``.
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import STATUS_LINE

from sidecar.transport.coalesce import CoalescingTransport


class UvicornCycle:
    """One request's uvicorn ``RequestResponseCycle`` as the relay reads it
    (``sidecar.transport.relay.Response``)."""

    __slots__ = ("_cycle",)

    def __init__(self, cycle: Any) -> None:
        self._cycle = cycle

    @property
    def transport(self) -> asyncio.Transport:
        transport: asyncio.Transport = self._cycle.transport
        return transport

    def relayable(self) -> bool:
        """A chunked body has started and not ended, and the client is still there."""
        cycle = self._cycle
        return bool(
            cycle.chunked_encoding is True
            and cycle.response_started
            and not cycle.response_complete
            and not cycle.disconnected
        )

    def write_paused(self) -> bool:
        return bool(self._cycle.flow.write_paused)

    def gone(self) -> bool:
        return bool(self._cycle.disconnected)

    def answer(self, status: int, head: list[tuple[bytes, bytes]], body: bytes) -> bool:
        """The whole response in one write, ended as uvicorn's ``send`` ends one
        (``sidecar.transport.relay.ClientRelay.answer``). Only for a response not yet started, to
        a client still there and not holding writes back, not a HEAD, with no access log line
        to write, and a ``head`` that names ``body``'s exact length; else False, nothing written.
        The header checks uvicorn's ``send`` makes are not repeated: every name and value in
        ``head`` came through llhttp's parser (D's headers, the client's request id)."""
        cycle = self._cycle
        if (
            cycle.response_started
            or cycle.disconnected
            or cycle.flow.write_paused
            or cycle.access_log
            or cycle.scope["method"] == "HEAD"
        ):
            return False
        length = b"%d" % len(body)
        content = [STATUS_LINE[status]]
        framed = False
        for name, value in (*cycle.default_headers, *head) if cycle.default_headers else head:
            if name == b"content-length":
                if framed or value != length:
                    return False
                framed = True
            elif name == b"transfer-encoding":
                return False
            content += (name, b": ", value, b"\r\n")
        if not framed:
            return False
        keep_alive = cycle.keep_alive
        if not keep_alive:
            content.append(b"connection: close\r\n")
        content += (b"\r\n", body)
        cycle.response_started = True
        cycle.waiting_for_100_continue = False
        cycle.chunked_encoding = False
        cycle.expected_content_length = 0
        transport = cycle.transport
        data = b"".join(content)
        if isinstance(transport, CoalescingTransport):
            transport.write_whole(data)
        else:
            transport.write(data)
        cycle.response_complete = True
        cycle.message_event.set()
        if not keep_alive:
            transport.close()
        cycle.on_response()
        return True
