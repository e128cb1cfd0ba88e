"""ASGI type aliases shared by the proxy's modules, and the server's disconnect hub."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

#: The scope key under which the sidecar's server puts its connection's ``DisconnectHub``.
DISCONNECT_HUB = "kvr.disconnect"
#: Scope extension: the server saw the request arrive above ``limit_concurrency``.
OVER_LIMIT = "kvr.over_limit"


def over_limit(scope: Scope) -> bool:
    """Whether the server marked this request as above ``limit_concurrency``: the app answers it
    with a 503 and ``connection: close`` (the proxy reads an inspected body first, so the blocks
    it names are released)."""
    extensions = scope.get("extensions")
    return extensions is not None and OVER_LIMIT in extensions


class DisconnectHub:
    """One per client connection, from the server protocol (``sidecar.server.protocol``): the callbacks
    of the requests running on it, called once when the connection is lost. A request watches
    for its client leaving with one set entry instead of a task of its own."""

    __slots__ = ("_callbacks", "gone")

    def __init__(self) -> None:
        self._callbacks: set[Callable[[], None]] = set()
        self.gone = False

    def add(self, callback: Callable[[], None]) -> None:
        self._callbacks.add(callback)

    def discard(self, callback: Callable[[], None]) -> None:
        self._callbacks.discard(callback)

    def lost(self) -> None:
        """The connection is gone: every watching request is told, once."""
        self.gone = True
        callbacks, self._callbacks = self._callbacks, set()
        for callback in callbacks:
            callback()
