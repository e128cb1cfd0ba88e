"""The one thread that owns the sidecar's NIXL agent (``sidecar.nixl.peer``).

Every call to the agent runs on this thread, which also drives UCX progress
after a send: a notification only leaves when UCX makes progress (connection
wire-up takes several rounds), so after a send the thread calls
``get_new_notifs()`` at least every ``PROGRESS_TICK`` for ``PROGRESS_WINDOW``,
then every ``SLOW_TICK`` until ``SLOW_WINDOW`` (a P slow to answer the
wire-up, on a loaded node, still gets the message), and then sleeps until the
next call. A thread whose call never returned is retired: it runs nothing
more that was queued, and ends once that call returns.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from sidecar.nixl import NixlError

log = logging.getLogger("sidecar.nixl.peer")

_T = TypeVar("_T")
PROGRESS_TICK = 0.0005  # seconds between progress calls while a send may be in flight
PROGRESS_WINDOW = 1.0  # seconds of progress after the last send (UCX wire-up needs several rounds)
SLOW_TICK = 0.01  # seconds between progress calls after that window...
SLOW_WINDOW = 30.0  # ...until this long after the last send (P's lease in vLLM 0.22.0+)


class Owner:
    """The one thread that owns the agent: runs submitted calls, drives UCX progress after sends.

    ``on_tick``, when set, is called on each progress tick instead of the plain progress call;
    it returns False when it made no progress call itself (nothing to send)."""

    def __init__(self) -> None:
        self._calls: queue.SimpleQueue[tuple[Callable[[], Any], concurrent.futures.Future[Any]] | None] = (
            queue.SimpleQueue()
        )
        self.agent: Any = None
        self.on_tick: Callable[[], bool] | None = None
        self._progress_until = 0.0
        self._slow_until = 0.0
        self._last_progress = float("-inf")
        self.retired = False
        self._thread = threading.Thread(target=self._run, name="kvr-nixl", daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], _T]) -> concurrent.futures.Future[_T]:
        future: concurrent.futures.Future[_T] = concurrent.futures.Future()
        self._calls.put((fn, future))
        return future

    def sent(self) -> None:
        """Called on the owner thread after a send: keep UCX progressing for a while."""
        now = time.monotonic()
        self._progress_until, self._slow_until = now + PROGRESS_WINDOW, now + SLOW_WINDOW

    def progressed(self) -> None:
        """Called on the owner thread after a progress call made outside ``_progress``."""
        self._last_progress = time.monotonic()

    def ticking(self) -> bool:
        """In the fast window for at least another tick: the thread takes the outbox by itself.

        Only the owner thread moves the window, so when another thread sees it open, the owner's
        current wait was computed in it too and ends within a tick."""
        return self._progress_until - time.monotonic() > 2 * PROGRESS_TICK

    def stop(self) -> None:
        self._calls.put(None)
        self._thread.join()

    def retire(self) -> None:
        """Give up on this thread (its call does not return): nothing queued runs any more, no
        progress is driven, and the thread ends when the call it is in returns."""
        self.retired = True
        self.on_tick, self.agent = None, None
        self._calls.put(None)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        while True:
            wait = self._due(time.monotonic())
            if wait is not None and wait <= 0:
                self._progress()  # due, whether or not calls are waiting: none waits behind the next
                continue
            try:
                item = self._calls.get(timeout=wait)
            except queue.Empty:
                continue  # the progress call is due now
            if item is None:
                return
            fn, future = item
            if self.retired:
                if future.set_running_or_notify_cancel():
                    future.set_exception(NixlError("the NIXL agent was replaced before this call ran"))
                continue
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as exc:
                    future.set_exception(exc)

    def _tick(self, now: float) -> float | None:
        """The progress interval at ``now`` (None: no progress is needed until the next send)."""
        if self._progress_until > now:
            return PROGRESS_TICK
        return SLOW_TICK if self._slow_until > now else None

    def _due(self, now: float) -> float | None:
        """Seconds until the next progress call is due (<= 0: now; None: none until a send)."""
        tick = self._tick(now)
        return None if tick is None else self._last_progress + tick - now

    def _progress(self) -> None:
        self._last_progress = time.monotonic()
        if self.agent is None:
            return
        try:
            if self.on_tick is not None and self.on_tick():
                return  # the batch it sent made this tick's progress call
            self.agent.get_new_notifs()
        except Exception as exc:  # NIXL raises its own exception types; the thread must go on
            log.warning("NIXL progress failed", extra={"error": str(exc)})
