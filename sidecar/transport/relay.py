"""A response body relayed from D's connection straight to the client's, once nothing in it is judged.

The proxy reads a stream's first event to judge it; the rest of D's body only
passes through. Handing each of those parts to the request's task (wake the
task, resume the pump, an ASGI message into the server's cycle, back to sleep)
cost several times what writing it costs. ``ClientRelay`` is one request's
way around that: the server protocol (``sidecar.server.protocol``) puts one in
the scope (the proxy drops it when the request ends), the proxy ``open``\\ s it
on D's connection (``sidecar.upstream.http1``), and
from then on that connection's ``data_received`` writes every body part it
parses to the client's transport, framed exactly as the server frames a body
message (one HTTP/1.1 chunk each), while the request's task waits once for
the body's end. What the proxy must still see (router mode's corrected
``cached_tokens``) is applied to each part on the way (``Feed``).

Back-pressure holds both ways: when the client's transport is over its
high-water mark (``pause``, from the server protocol's ``pause_writing``) D's
connection stops reading until it drains (``resume``), so a slow client
throttles D rather than growing the sidecar's memory. A client that leaves
gets nothing more written (the server's cycle is marked disconnected) and its
request's task is cancelled as before. Only a chunked response that has
started and not ended is relayed; anything else takes the pump as before.

The same seam carries a JSON answer D sent whole, which nothing judges byte by
byte once its status is judged: ``answer`` writes its head and body in one
write and ends the response as the server would, without the two response
messages and their header checks (D's head was parsed and filtered already).
"""

from __future__ import annotations

import asyncio
from typing import Protocol

RELAY = "kvr.relay"  # scope key: the request's ``ClientRelay``, from the server protocol


class Feed(Protocol):
    """A filter on the relayed parts (``sidecar.proxy.usage.UsageRewriter``)."""

    def feed(self, chunk: bytes) -> bytes: ...


class Reader(Protocol):
    """D's side (``sidecar.upstream.http1.Connection``): stops and resumes reading for the relay."""

    def pause_relay(self) -> None: ...

    def resume_relay(self) -> None: ...


class Response(Protocol):
    """The client's response as the server exposes it (``sidecar.server.cycle.Cycle``)."""

    @property
    def transport(self) -> asyncio.Transport: ...

    def relayable(self) -> bool: ...

    def write_paused(self) -> bool: ...

    def gone(self) -> bool: ...

    def answer(self, status: int, head: list[tuple[bytes, bytes]], body: bytes) -> bool: ...


class Host(Protocol):
    """The server protocol the client's connection runs on (``sidecar.server.protocol.GuardedProtocol``)."""

    def relaying(self, relay: ClientRelay | None) -> None: ...


class ClientRelay:
    """One request's relay to its client (see the module docstring)."""

    __slots__ = ("_feed", "_host", "_reader", "_response", "_transport")

    def __init__(self, host: Host, response: Response) -> None:
        self._host = host
        self._response = response
        self._reader: Reader | None = None
        self._feed: Feed | None = None
        self._transport: asyncio.Transport = response.transport

    def open(self, reader: Reader, feed: Feed | None = None) -> bool:
        """Relay to the client from now on; False when this response cannot be relayed."""
        response = self._response
        if not response.relayable():
            return False
        self._reader, self._feed = reader, feed
        self._transport = response.transport
        self._host.relaying(self)
        if response.write_paused():
            reader.pause_relay()
        return True

    def answer(self, status: int, head: list[tuple[bytes, bytes]], body: bytes) -> bool:
        """D's whole answer, its head and all of its body (``head`` frames it by its
        ``content-length``), to the client in one write, past the server's response messages;
        False, having written nothing, when this response cannot take it that way (then it goes
        through the server as before)."""
        return self._response.answer(status, head, body)

    def write(self, body: bytes) -> None:
        """One part of D's body, as one chunk to the client (nothing once the client left)."""
        self.write_all([body])

    def write_all(self, parts: list[bytes]) -> None:
        """The parts of one read from D, one chunk each, in one write (nothing once the client
        left). An empty part would end the body: a part the filter holds back is left out."""
        feed = self._feed
        if len(parts) == 1:  # one event a read, as a stream's events come: no list made
            part = parts[0] if feed is None else feed.feed(parts[0])
            if part and not self._response.gone():
                self._transport.write(b"%x\r\n%b\r\n" % (len(part), part))
            return
        if feed is not None:
            parts = [part for part in map(feed.feed, parts) if part]
        if parts and not self._response.gone():
            self._transport.write(b"".join([b"%x\r\n%b\r\n" % (len(part), part) for part in parts]))

    def close(self) -> None:
        """The relayed part is over: the rest of the response goes through the server as before."""
        if self._reader is not None:
            self._host.relaying(None)
            self._reader = None

    def pause(self) -> None:
        """The client's transport is full: D's connection stops reading."""
        if self._reader is not None:
            self._reader.pause_relay()

    def resume(self) -> None:
        if self._reader is not None:
            self._reader.resume_relay()
