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
after a send the owner thread drives progress itself (``get_new_notifs()``)
at least every ``PROGRESS_TICK`` for ``PROGRESS_WINDOW``, then every
``SLOW_TICK`` until ``SLOW_WINDOW`` (a P slow to answer the wire-up, on a
loaded node, still gets the message), and then sleeps until the next call: CPU
is spent only while releasing. A progress call is made when one is due (the
tick since the last one passed), not after every call: while releases keep
coming, the progress call each batch of notifications makes before sending
is the progress, and one more is made only when the tick passes without one.

Notifications are batched (``notify_many``): callers put their messages in
an outbox on the event loop, and the owner thread takes the whole outbox in
one go (one progress call, every send, one hand-back to the event loop).
Within the fast window the owner thread is awake every ``PROGRESS_TICK``
anyway, so it takes the outbox on that tick and nobody wakes it; outside it
(the first release after a quiet spell) the caller wakes it with a call. So
under load the hops to the thread and back cost per tick, not per job, and a
notification waits at most a tick (and the GIL) for its thread.

A call that has not returned after ``STUCK_CALL`` (an ``add_remote_agent``
seen blocked in UCX for 30 s on a loaded node) would hold every release of
the process behind it, since one thread owns the agent. So the agent is
replaced: its thread is retired (it runs nothing more and ends when the call
returns), a new agent with a new name is made on a new thread, the callers
waiting get the retryable ``NixlError``, and ``on_replaced`` callbacks run
(the session forgets the P agents the old one knew, so the retry handshakes
again).
"""

from __future__ import annotations

import asyncio
import collections
import importlib
import logging
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from sidecar.nixl import NixlError
from sidecar.nixl.owner import PROGRESS_TICK, PROGRESS_WINDOW
from sidecar.nixl.owner import Owner as _Owner
from sidecar.observability import logs

log = logging.getLogger(__name__)

_T = TypeVar("_T")
_MODULES = ("nixl._api", "nixl_cu12._api")
SLOW_CALL = 1.0  # seconds: a call to the agent's thread that took longer is logged
STUCK_CALL = 5.0  # seconds: a call not returned by then is given up on, and the agent replaced


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


Results = list[str | None]  # per message: None when sent, else the error's text
_Asked = tuple[Sequence[tuple[str, bytes]], "asyncio.Future[Results]"]


class NixlPeer:
    """One NIXL agent (UCX backend) and the thread that owns it."""

    def __init__(self, name: str | None = None, backends: Sequence[str] = ("UCX",)) -> None:
        self.name = name or agent_name()
        self._backends = list(backends)
        self._owner: _Owner | None = None
        self._agent: Any = None
        # ``notify_many`` calls waiting for the owner thread (appended on the event loop, taken
        # whole on the owner thread) and whether a batch call is queued there that will take them.
        self._outbox: collections.deque[_Asked] = collections.deque()
        self._batch_queued = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self.batches = 0  # batches sent, and the notify_many calls they carried (diagnostics)
        self.batched = 0
        self.on_replaced: list[Callable[[], None]] = []
        self._replacing: asyncio.Future[None] | None = None

    def ready(self) -> bool:
        return self._agent is not None

    async def start(self) -> None:
        """Create the agent on its thread; raises ``NixlError`` when NIXL is unusable."""
        self._owner = _Owner()
        self._loop = asyncio.get_running_loop()
        started = time.monotonic()
        # Not a slow call when it takes a second or two: it imports NIXL and loads UCX, once.
        self._agent = await self._call(self._create, None)
        self._owner.agent = self._agent
        self._owner.on_tick = self._take_outbox
        extra = {
            "agent": self.name,
            "backends": self._backends,
            "seconds": round(time.monotonic() - started, 3),
        }
        log.info("NIXL agent started", extra=extra)

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
        await asyncio.wrap_future(owner.submit(lambda: None))  # a batch queued before runs first
        _answer(self._outbox, NixlError("NIXL agent is closed"))
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
        return bytes(await self._call(lambda: self._require().get_agent_metadata(), "get_agent_metadata"))

    async def add_remote(self, metadata: bytes) -> str:
        """Load a P worker's agent metadata; returns the remote agent's name."""
        name = await self._call(lambda: self._require().add_remote_agent(metadata), "add_remote_agent")
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

        await self._call(remove, "remove_remote_agent")

    async def notify(self, name: str, message: bytes) -> None:
        """Send one notification to a remote agent."""

        def send() -> None:
            self._require().send_notif(name, message)
            self._sent()

        await self._call(send, "send_notif")

    async def notify_many(self, messages: Sequence[tuple[str, bytes]]) -> Results:
        """Send several notifications in one hop to the NIXL thread, batched with the other
        callers' that ask meanwhile (see the module docstring).

        Returns, per message, None when it was sent or the error text; a failure
        does not stop the others (each rank frees independently). Raises the retryable
        ``NixlError`` when nothing was sent (the progress call before sending failed).
        """
        owner = self._owner
        if owner is None:
            raise NixlError("NIXL agent is not started")
        future: asyncio.Future[Results] = asyncio.get_running_loop().create_future()
        self._outbox.append((messages, future))
        if not self._batch_queued and not owner.ticking():
            self._batch_queued = True
            owner.submit(self._send_batch)
        started = time.monotonic()
        try:
            return await self._within(future, owner, "send_notif")
        finally:
            _slow("send_notif", started)

    def _send_batch(self) -> None:
        """On the owner thread, woken by a caller: the flag goes down before the outbox is taken,
        so a call appended after the take wakes the thread again, and none is left behind."""
        self._batch_queued = False
        self._take_outbox()

    def _take_outbox(self) -> bool:
        """On the owner thread: take every waiting ``notify_many`` call, send, hand the results
        back; False when there was none (no progress call made)."""
        batch: list[_Asked] = []
        while self._outbox:
            asked = self._outbox.popleft()
            if not asked[1].done():  # a caller cancelled before its batch ran sends nothing
                batch.append(asked)
        if not batch:
            return False
        try:
            answers: list[Results | BaseException] = list(self._send_all(batch))
        except BaseException as exc:  # every caller gets an answer, whatever happened
            answers = [exc] * len(batch)
        self.batches, self.batched = self.batches + 1, self.batched + len(batch)
        assert self._loop is not None, "start() first"
        self._loop.call_soon_threadsafe(_deliver, [asked[1] for asked in batch], answers)
        return True

    def _send_all(self, batch: list[_Asked]) -> list[Results]:
        agent = self._require()
        owner = self._owner
        # One progress call first: UCX notices the remote agents that went away while this
        # agent was idle (P re-registered its workers), so send_notif to them fails here and
        # the caller handshakes again, instead of "succeeding" into a dead endpoint.
        try:
            agent.get_new_notifs()
        except Exception as exc:  # NIXL's own types: the job retries (NixlError is retryable)
            raise NixlError(f"NIXL progress before sending failed: {exc}") from exc
        finally:
            if owner is not None:
                owner.progressed()
        answers: list[Results] = []
        for messages, _ in batch:
            results: Results = []
            for name, message in messages:
                try:
                    agent.send_notif(name, message)
                    results.append(None)
                except Exception as exc:  # NIXL raises its own exception types
                    results.append(f"{type(exc).__name__}: {exc}")
            answers.append(results)
        self._sent()
        return answers

    def _sent(self) -> None:
        if self._owner is not None:
            self._owner.sent()

    def _require(self) -> Any:
        if self._agent is None:
            raise NixlError("NIXL agent is not started")
        return self._agent

    async def _call(self, fn: Callable[[], _T], what: str | None) -> _T:
        """``fn`` on the agent's thread; ``what`` names it in the slow call warning and bounds
        it by ``STUCK_CALL`` (None: neither, for making the agent)."""
        owner = self._owner
        if owner is None:
            raise NixlError("NIXL agent is not started")
        started = time.monotonic()
        waiting = asyncio.wrap_future(owner.submit(fn))
        try:
            return await (waiting if what is None else self._within(waiting, owner, what))
        except NixlError:
            raise
        except Exception as exc:  # NIXL raises its own exception types
            raise NixlError(f"{type(exc).__name__}: {exc}") from exc
        finally:
            if what is not None:
                _slow(what, started)

    async def _within(self, waiting: asyncio.Future[_T], owner: _Owner, what: str) -> _T:
        """``waiting``'s result, unless ``STUCK_CALL`` passes first: then the agent is replaced
        and the caller gets the retryable ``NixlError``."""
        try:
            # asyncio.wait, not wait_for: a caller's cancellation reaches the except below in the
            # same step of the loop, so ``waiting`` is cancelled before the owner thread can take it.
            done, _ = await asyncio.wait((waiting,), timeout=STUCK_CALL)
        except asyncio.CancelledError:
            waiting.cancel()  # the caller left: a call not started yet is not made
            raise
        if done:
            return waiting.result()
        await self._replace(owner, what)
        raise NixlError(f"NIXL call {what} did not return in {STUCK_CALL:g} s; the agent was replaced")

    async def _replace(self, stuck: _Owner, what: str) -> None:
        """Replace the agent ``stuck`` owns, once, whoever else found it stuck meanwhile."""
        if self._owner is not stuck:
            return  # replaced already
        if self._replacing is None:
            self._replacing = asyncio.ensure_future(self._restart(stuck, what))
        await asyncio.shield(self._replacing)

    async def _restart(self, stuck: _Owner, what: str) -> None:
        old = self.name
        try:
            stuck.retire()
            self._batch_queued = False
            _answer(self._outbox, NixlError(f"the NIXL agent was replaced: its {what} call did not return"))
            self._agent, self.name = None, agent_name()
            self._owner = owner = _Owner()
            self._agent = await asyncio.wrap_future(owner.submit(self._create))
            owner.agent, owner.on_tick = self._agent, self._take_outbox
            extra = {"call": what, "seconds": STUCK_CALL, "old_agent": old, "agent": self.name}
            log.error("NIXL agent replaced: a call to it did not return", extra=extra)
            for callback in self.on_replaced:
                callback()
        finally:
            self._replacing = None


def _slow(what: str, started: float) -> None:
    """Log a call to the agent's thread that took over ``SLOW_CALL`` (waiting for the thread included)."""
    took = time.monotonic() - started
    if took > SLOW_CALL:
        log.warning("NIXL call was slow", extra={"call": what, "seconds": round(took, 3)})


def _deliver(futures: list[asyncio.Future[Results]], answers: list[Results | BaseException]) -> None:
    """On the event loop: each ``notify_many`` caller of a batch gets its answer."""
    for future, answer in zip(futures, answers, strict=True):
        if future.done():
            continue
        if isinstance(answer, BaseException):
            future.set_exception(answer)
        else:
            future.set_result(answer)


def _answer(outbox: collections.deque[_Asked], error: NixlError) -> None:
    """Callers still waiting when the agent closes get ``error``."""
    while outbox:
        future = outbox.popleft()[1]
        if not future.done():
            future.set_exception(error)
