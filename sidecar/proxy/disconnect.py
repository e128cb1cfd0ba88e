"""Watching for the client leaving while the proxy waits on D.

ASGI servers silently drop ``send`` after a disconnect, so without a watcher
a long generation would run on at D for nobody. ``DisconnectWatcher``
cancels the request's task when the client disconnects. Under the sidecar's
own server it registers with the connection's ``DisconnectHub`` (no task per
request); elsewhere, and for a passthrough request whose body it streams to D
(``body()``), a task listens on ``receive`` (once the body is complete).
A watcher made ``deferred`` only notes the client leaving (``fired``) until
``arm()``: router mode's prefill leg runs to P's answer in the request's own
task, then releases what P kept if the client left meanwhile.
``client_gone`` says what the client's leaving means for P's blocks.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from sidecar.asgi import DisconnectHub, Receive
from sidecar.classify import Event, NoAnswer
from sidecar.proxy.context import ClientGone, Exchange


class DisconnectWatcher:
    """Cancels the current task when the client disconnects (see the module docstring)."""

    __slots__ = ("_body_done", "_deferred", "_hub", "_owner", "_receive", "_task", "body_pending", "fired")

    def __init__(
        self,
        receive: Receive,
        body_pending: bool = False,
        hub: DisconnectHub | None = None,
        *,
        deferred: bool = False,
    ) -> None:
        self._receive = receive
        self._owner = asyncio.current_task()
        self._deferred = deferred  # until ``arm()``: the client's leaving is noted, not acted on
        self.body_pending = body_pending
        self.fired = False
        self._task: asyncio.Task[None] | None = None
        self._hub: DisconnectHub | None = None
        self._body_done: asyncio.Event | None = None
        if hub is not None and not body_pending:
            self._hub = hub
            hub.add(self._fire)
            if hub.gone:
                self._fire()
            return
        # Only a passthrough body still being streamed to D needs the watcher to wait.
        self._body_done = asyncio.Event() if body_pending else None
        self._task = asyncio.create_task(self._watch())

    async def body(self) -> AsyncIterator[bytes]:
        try:
            while True:
                message = await self._receive()
                if message["type"] == "http.disconnect":
                    self._fire()
                    # Raised, not returned: a body that ends normally gets its chunked terminator,
                    # and D would take a cut upload for a whole one. The client's connection
                    # aborts the one to D instead.
                    raise ClientGone
                chunk = message.get("body", b"")
                if chunk:
                    yield chunk
                if not message.get("more_body", False):
                    return
        finally:
            if self._body_done is not None:
                self._body_done.set()

    async def _watch(self) -> None:
        if self._body_done is not None:
            await self._body_done.wait()
            if self.fired:
                return
        while True:
            message = await self._receive()
            if message["type"] == "http.disconnect":
                self._fire()
                return

    def _fire(self) -> None:
        if not self.fired and self._owner is not None:
            self.fired = True
            if not self._deferred:
                self._owner.cancel()

    def arm(self) -> None:
        """From now on the client's leaving cancels the task; at once if it already left."""
        deferred, self._deferred = self._deferred, False
        if deferred and self.fired and self._owner is not None:
            self._owner.cancel()

    def stop(self) -> None:
        """Stop watching. The task reference is dropped: the cancelled task keeps its
        ``CancelledError``, whose traceback holds the ``_watch`` frame and so this watcher; with
        the reference kept, every request would leave a cycle for the garbage collector."""
        task, self._task, self._owner = self._task, None, None
        if task is not None:
            task.cancel()
        hub, self._hub = self._hub, None
        if hub is not None:
            hub.discard(self._fire)


def client_gone(exchange: Exchange) -> Event:
    """The client left before the exchange was judged: what D may have of it."""
    if exchange.responded:  # D answered 200 and streams: it has the request
        return Event(status=200, stream=True)
    if exchange.sent is not None and exchange.sent.may_have_reached_d:  # D may have admitted it
        return Event(failure=NoAnswer.CLIENT_GONE_AFTER_FORWARD)
    return Event(failure=NoAnswer.CLIENT_GONE_BEFORE_FORWARD)


def uncancel() -> None:
    """Take back a cancellation the watcher (or shutdown) made, once it has been handled."""
    task = asyncio.current_task()
    if task is not None:
        task.uncancel()
