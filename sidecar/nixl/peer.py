"""The sidecar's own NIXL agent, owned by one dedicated thread.

NIXL calls block (``add_remote_agent`` creates UCX endpoints, ``send_notif``
may wait on the transport), so none runs on the event loop: every call is
submitted to one thread (``_Owner``) that also created the agent, and the
async methods await its result. NIXL is imported lazily (``nixl._api``, else
``nixl_cu12._api``) so the sidecar starts without it when another strategy is
chosen. NIXL exceptions become ``NixlError`` here, once.

The agent runs without NIXL's progress thread: that thread busy-polls UCX and
cost 0.89 of a core on an idle sidecar (measured). A notification only
leaves when UCX makes progress (connection wire-up takes several rounds), so
after every send the owner thread drives progress itself
(``get_new_notifs()``) every ``PROGRESS_TICK`` for ``PROGRESS_WINDOW``, then
every ``SLOW_TICK`` until ``SLOW_WINDOW`` (a P slow to answer the wire-up, on a
loaded node, still gets the message), and then sleeps until the next call: CPU
is spent only while releasing.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import importlib
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from sidecar.nixl import NixlError
from sidecar.observability import logs

log = logging.getLogger(__name__)

_T = TypeVar("_T")
_MODULES = ("nixl._api", "nixl_cu12._api")
PROGRESS_TICK = 0.0005  # seconds between progress calls while a send may be in flight
PROGRESS_WINDOW = 1.0  # seconds of progress after the last send (UCX wire-up needs several rounds)
SLOW_TICK = 0.01  # seconds between progress calls after that window...
SLOW_WINDOW = 30.0  # ...until this long after the last send (P's lease in vLLM 0.22.0+)


class _Owner:
    """The one thread that owns the agent: runs submitted calls, drives UCX progress after sends."""

    def __init__(self) -> None:
        self._calls: queue.SimpleQueue[tuple[Callable[[], Any], concurrent.futures.Future[Any]] | None] = (
            queue.SimpleQueue()
        )
        self.agent: Any = None
        self._progress_until = 0.0
        self._slow_until = 0.0
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

    def stop(self) -> None:
        self._calls.put(None)
        self._thread.join()

    def _run(self) -> None:
        while True:
            tick = self._tick(time.monotonic())
            try:
                item = self._calls.get(timeout=tick)
            except queue.Empty:
                self._progress()
                continue
            if item is None:
                return
            fn, future = item
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as exc:
                    future.set_exception(exc)
            if self._progress_until > time.monotonic():
                self._progress()

    def _tick(self, now: float) -> float | None:
        """How long to wait for the next call before driving progress (None: until a call)."""
        if self._progress_until > now:
            return PROGRESS_TICK
        return SLOW_TICK if self._slow_until > now else None

    def _progress(self) -> None:
        if self.agent is not None:
            try:
                self.agent.get_new_notifs()
            except Exception as exc:  # NIXL raises its own exception types
                log.warning("NIXL progress failed", extra={"error": str(exc)})


def import_nixl() -> Any:
    """The NIXL Python API module; raises ``NixlError`` when no build is installed."""
    errors = []
    for name in _MODULES:
        try:
            return importlib.import_module(name)
        except ImportError as exc:
            errors.append(f"{name}: {exc}")
    raise NixlError("NIXL is not installed (" + "; ".join(errors) + ")")


def agent_name() -> str:
    """A name unique to this process and start (P learns it from our notifications)."""
    return f"kvr-sidecar-{uuid.uuid4()}"


class NixlPeer:
    """One NIXL agent (UCX backend) and the thread that owns it."""

    def __init__(self, name: str | None = None, backends: Sequence[str] = ("UCX",)) -> None:
        self.name = name or agent_name()
        self._backends = list(backends)
        self._owner: _Owner | None = None
        self._agent: Any = None

    def ready(self) -> bool:
        return self._agent is not None

    async def start(self) -> None:
        """Create the agent on its thread; raises ``NixlError`` when NIXL is unusable."""
        self._owner = _Owner()
        self._agent = await self._call(self._create)
        self._owner.agent = self._agent
        log.info("NIXL agent started", extra={"agent": self.name, "backends": self._backends})

    def _create(self) -> Any:
        api = import_nixl()
        logs.adopt("nixl")  # NIXL's import installed its own text handler on stdout
        config = api.nixl_agent_config(enable_prog_thread=False, backends=self._backends)
        return api.nixl_agent(self.name, config)

    async def close(self) -> None:
        """Drop the agent on its thread, then stop the thread."""
        owner, self._owner = self._owner, None
        if owner is None:
            return
        holder = [self._agent] if self._agent is not None else []
        self._agent = None

        def drop() -> None:
            # Flush what is in flight, then let the last reference die on the owning thread.
            deadline = time.monotonic() + PROGRESS_WINDOW
            while owner.agent is not None and time.monotonic() < deadline:
                owner.agent.get_new_notifs()
                time.sleep(PROGRESS_TICK)
            owner.agent = None
            holder.clear()

        await asyncio.wrap_future(owner.submit(drop))
        await asyncio.to_thread(owner.stop)

    async def metadata(self) -> bytes:
        """This agent's own metadata (for tests and diagnostics)."""
        return bytes(await self._call(lambda: self._require().get_agent_metadata()))

    async def add_remote(self, metadata: bytes) -> str:
        """Load a P worker's agent metadata; returns the remote agent's name."""
        name = await self._call(lambda: self._require().add_remote_agent(metadata))
        return name.decode() if isinstance(name, bytes) else str(name)

    async def remove_remote(self, names: Sequence[str]) -> None:
        """Forget remote agents (disconnects them); failures are logged, not raised."""

        def remove() -> None:
            agent = self._require()
            for name in names:
                try:
                    agent.remove_remote_agent(name)
                except Exception as exc:  # NIXL raises its own exception types
                    log.warning("remove_remote_agent failed", extra={"remote": name, "error": str(exc)})

        await self._call(remove)

    async def notify(self, name: str, message: bytes) -> None:
        """Send one notification to a remote agent."""

        def send() -> None:
            self._require().send_notif(name, message)
            self._sent()

        await self._call(send)

    async def notify_many(self, messages: Sequence[tuple[str, bytes]]) -> list[str | None]:
        """Send several notifications in one hop to the NIXL thread.

        Returns, per message, None when it was sent or the error text; a failure
        does not stop the others (each rank frees independently).
        """

        def send() -> list[str | None]:
            agent = self._require()
            # One progress call first: UCX notices the remote agents that went away while this
            # agent was idle (P re-registered its workers), so send_notif to them fails here and
            # the caller handshakes again, instead of "succeeding" into a dead endpoint.
            try:
                agent.get_new_notifs()
            except Exception as exc:  # NIXL's own types: the job retries (NixlError is retryable)
                raise NixlError(f"NIXL progress before sending failed: {exc}") from exc
            results: list[str | None] = []
            for name, message in messages:
                try:
                    agent.send_notif(name, message)
                    results.append(None)
                except Exception as exc:  # NIXL raises its own exception types
                    results.append(f"{type(exc).__name__}: {exc}")
            self._sent()
            return results

        owner = self._owner
        if owner is None:
            raise NixlError("NIXL agent is not started")
        return await asyncio.wrap_future(owner.submit(send))

    def _sent(self) -> None:
        if self._owner is not None:
            self._owner.sent()

    def _require(self) -> Any:
        if self._agent is None:
            raise NixlError("NIXL agent is not started")
        return self._agent

    async def _call(self, fn: Callable[[], _T]) -> _T:
        owner = self._owner
        if owner is None:
            raise NixlError("NIXL agent is not started")
        try:
            return await asyncio.wrap_future(owner.submit(fn))
        except NixlError:
            raise
        except Exception as exc:  # NIXL raises its own exception types
            raise NixlError(f"{type(exc).__name__}: {exc}") from exc
