"""D's state for the release decision: can D's own engine notify P right now?

From vLLM 0.21.0 D notifies P itself for rejections raised inside its wrapped
completion handlers (``sidecar.decision.coverage``), but only while its engine
runs, is not shutting down, and D has a KV connector; otherwise the release is
lost unless the sidecar sends it. ``DecodeState`` keeps one ``DecodeView``,
replaced whole by a poller task and by passive signals, so ``view()`` on the
request path is one attribute read. Under doubt the view says "cannot notify":
a release sent twice is harmless unless D's TP is larger than P's and it lands
between D's readers' messages, a release skipped is always lost.

The signals, read in vLLM 0.21.0, 0.25.1, 0.27.0, 0.28.0, 0.29.0, 0.31.0, 0.33.0 and
0.34.0 (pinned in ``tests/conformance/test_vllm_decode_state_source.py``):

* ``GET /health`` (``serve/instrumentator/health.py``: ``health``) answers 503
  when ``check_health`` raises ``EngineDeadError``, i.e. when ``AsyncLLM.errored``
  (``engine_dead`` or the output handler stopped); 200 otherwise. Polled every
  ``interval``: 200 alive, 503 dead, anything else or no answer unknown.
* A dead engine's answers: ``EngineDeadError`` becomes 500 ``InternalServerError``
  with the message ``str(exc)``, "EngineCore encountered an issue. See stack trace
  (above) for the root cause." (``create_error_response``, 0.21.0-0.31.0), and in
  0.33.0 ``EngineDeadError.CLIENT_MESSAGE``, "The server had an error while
  processing your request." Neither text has another source; ``observe`` marks
  the engine dead at once. vLLM's watchdog (``watchdog_loop``, every 5 s) then
  stops the HTTP server unless ``VLLM_KEEP_ALIVE_ON_ENGINE_DEATH``.
* Shutdown (SIGTERM): ``MPClient.shutdown`` (``v1/engine/core_client.py``) stops
  the engine processes first and sets ``engine_dead`` only afterwards
  (``BackgroundResources.__call__``), so ``/health`` answers 200 while the engine
  core drops every ADD, the ``abort_immediately`` one included
  (``EngineCore._reject_add_in_shutdown``). From 0.28.0 (``NoSignalServer``) the HTTP
  server runs unchanged during that drain: D shows its shutdown nowhere until
  ``/health`` turns 503 and then connections are refused. Up to 0.27.x uvicorn's
  own SIGTERM handler (``Server.capture_signals``) also runs: the listener closes at
  once (refused connections) and answers in flight carry ``Connection: close``,
  which vLLM never sets itself; the probes and ``observe(closing=True)`` read it.
  The sidecar's own SIGTERM (``draining``) counts as shutting down too.
* A faulted engine (0.34.0, fault tolerance on): ``AsyncLLM.check_admission``
  answers every request 503 ``EngineFaultedError`` while the engine core is not
  healthy, and ``/health`` stays 200. D's own notification then waits in the
  faulted engine core until it recovers, if ever. ``observe`` marks D faulted
  for ``FAULTED_HOLD`` seconds after each such answer (under traffic every
  request renews it), and D's other rejections are then released by the sidecar.
* The KV connector: see ``sidecar.decode.probes`` (``/metrics`` families), read on
  each (re)contact with D and every ``INFO_MAX_AGE`` with ``/version``;
  ``kv_connector`` "yes"/"no" overrides it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from sidecar.classify import ENGINE_FAULTED_MESSAGE, NoAnswer
from sidecar.config import KvConnectorSetting
from sidecar.decode.probes import (
    Engine,
    VersionRead,
    probe_health,
    read_kv_connector,
    read_version,
    unreachable_cause,
)
from sidecar.upstream import Client

log = logging.getLogger("sidecar.decode_state")

#: ``/version`` and ``/metrics`` are re-read at least this often (seconds), and on each re-contact.
INFO_MAX_AGE = 300.0
#: Seconds start-up waits for the first probe of D.
START_BOUND = 2.0
#: What a client gets from D when its engine is dead (500 ``InternalServerError``).
ENGINE_DEAD_MESSAGES = frozenset(
    {
        "EngineCore encountered an issue. See stack trace (above) for the root cause.",  # 0.21-0.31
        "The server had an error while processing your request.",  # 0.33: EngineDeadError.CLIENT_MESSAGE
    }
)
#: Seconds after D's last ``EngineFaultedError`` answer during which D counts as unable to notify.
FAULTED_HOLD = 10.0
#: Failures that leave D's engine unknown: nothing listens, or D dropped the connection.
UNREACHABLE = frozenset(
    {
        NoAnswer.CONNECT_REFUSED,
        NoAnswer.DNS,
        NoAnswer.CONNECT_TIMEOUT,
        NoAnswer.TLS_FAILED,
        NoAnswer.RESET_AFTER_SEND,
    }
)


@dataclass(frozen=True, slots=True)
class DecodeView:
    """What the sidecar knows of D at one moment; replaced whole, never changed."""

    engine: Engine  # from D's /health (200 / 503 / no answer yet or unreachable)
    shutting_down: bool  # this pod is terminating (the sidecar's SIGTERM) or D's server is exiting
    kv_connector: bool | None  # None: cannot tell
    version: str | None
    faulted: bool = False  # D answered EngineFaultedError in the last FAULTED_HOLD seconds

    @property
    def can_notify(self) -> bool:
        """Whether D's own release (vLLM 0.21.0+) can reach P now."""
        return (
            self.engine == "alive"
            and not self.shutting_down
            and self.kv_connector is not False
            and not self.faulted
        )

    @property
    def reason(self) -> str:
        """Why D cannot notify ("" when it can), for logs."""
        if self.shutting_down:
            return "shutting down"
        if self.engine != "alive":
            return "engine dead" if self.engine == "dead" else "D not answering /health"
        if self.faulted:
            return "engine faulted"
        return "no KV connector" if self.kv_connector is False else ""


def engine_faulted_answer(status: int, message: str | None) -> bool:
    """Whether D's error answer (or a stream's first error event) is a faulted engine's."""
    return status == 503 and message == ENGINE_FAULTED_MESSAGE


def engine_dead_answer(status: int, message: str | None) -> bool:
    """Whether D's error answer (or a stream's first error event) is a dead engine's."""
    return status == 500 and message in ENGINE_DEAD_MESSAGES


class DecodeState:
    """D's state, kept by one poller task (``start``/``close``) and passive signals."""

    def __init__(
        self,
        upstream: Client,
        *,
        interval: float,
        clock: Callable[[], float] = time.monotonic,
        kv_connector: KvConnectorSetting = "auto",
        on_version: Callable[[VersionRead], None] = lambda _: None,
    ) -> None:
        self._upstream = upstream
        self._interval = interval
        self._clock = clock
        self._setting = kv_connector
        self._on_version = on_version  # told each /version answer of D (``sidecar.decode.notice``)
        self._engine: Engine = "unknown"
        self._engine_at = float("-inf")  # when the engine value was learnt (a probe's start)
        self._health: Engine = "unknown"  # what /health last answered (alive or dead)
        self._wake = asyncio.Event()  # probe now, not at the next interval
        self._exiting = False  # D's server said Connection: close
        self._exiting_at = float("-inf")
        self._draining = False
        self._probed_kv: bool | None = None
        self._kv_read = False
        self._version: str | None = None
        self._info_due = float("-inf")
        self._faulted_until = float("-inf")
        self._task: asyncio.Task[None] | None = None
        self._probed_at = float("-inf")
        self._lock = asyncio.Lock()
        self._view = DecodeView("unknown", False, self._kv(), None)

    def view(self) -> DecodeView:
        """The current view (sync, O(1): one attribute read)."""
        return self._view

    # --- what the judge reads (sidecar.decision.judge.DecodeWatch) --------------------------------

    def version(self) -> str | None:
        """D's vLLM release as last read (P runs the same)."""
        return self._view.version

    def can_notify(self) -> bool:
        """D's engine could send its own release now."""
        return self._view.can_notify

    async def start(self) -> None:
        """Probe D once (so the first view is D's; at most ``START_BOUND`` seconds: D that does
        not answer, e.g. not started yet, leaves it "unknown"), then poll every ``interval``.
        ``interval`` 0: nothing until someone asks (``fresh``)."""
        if not self._interval:
            return
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(START_BOUND):
                await self.refresh()
                if self._health == "unknown":  # say once why, or D's absence shows only in /readyz
                    cause = await unreachable_cause(self._upstream)
                    if cause is not None:
                        log.warning(
                            "D cannot be reached at start-up: %s; /readyz stays 503 until it answers", cause
                        )
        self._task = asyncio.create_task(self._poll_forever(), name="decode-state")

    async def close(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def draining(self) -> None:
        """The sidecar got SIGTERM: this pod is terminating (sticky)."""
        self._draining = True
        self._publish()

    def observe(self, signal: NoAnswer | int, message: str | None = None, *, closing: bool = False) -> None:
        """A passive signal from the request path: the failure that kept D's answer from arriving,
        or D's status (or a stream's first error code) with its error message; ``closing``: the
        answer said ``Connection: close``.

        A failure to reach D, or a dead engine's answer, lowers the view at once. Any other answer
        while D was unreachable means D's server is back: vLLM serves its routes only once its
        engine runs, so the engine is what ``/health`` last said (alive when it never answered),
        and ``/health``, ``/version`` and ``/metrics`` are read again at once. Otherwise a
        rejection D's own fix has just released would be sent again by the sidecar.
        """
        now = self._clock()
        if isinstance(signal, NoAnswer):
            if signal in UNREACHABLE:
                self._engine, self._engine_at = "unknown", now
        elif engine_dead_answer(signal, message):
            self._engine, self._engine_at = "dead", now
        elif engine_faulted_answer(signal, message):
            self._faulted_until = now + FAULTED_HOLD
        elif self._engine == "unknown":
            self._engine, self._engine_at = ("dead" if self._health == "dead" else "alive"), now
            self._info_due = now  # it may be another process now
            self._wake.set()
        if closing:
            self._exiting, self._exiting_at = True, now
        self._publish()

    async def fresh(self, max_age: float = 1.0) -> DecodeView:
        """The view, probed now when no poller keeps it and the last probe is older than
        ``max_age`` (``/readyz`` with ``interval`` 0)."""
        if not self._interval and self._clock() - self._probed_at >= max_age:
            await self.refresh()
        return self._view

    async def refresh(self) -> DecodeView:
        """Probe D now (``/health``; ``/version`` and ``/metrics`` when due) and publish."""
        started = self._probed_at = self._clock()
        engine, closing = await probe_health(self._upstream)
        if engine != "unknown":
            self._health = engine
        if engine == "alive" and self._engine != "alive":
            self._info_due = started  # D (re)appeared: it may be another process now
        if engine == "alive" and started >= self._info_due:
            await self._read_info(started)
        if started >= self._engine_at:
            self._engine, self._engine_at = engine, started
        if engine != "unknown" and started >= self._exiting_at:  # only an answer tells
            self._exiting, self._exiting_at = closing, started
        self._publish()
        return self._view

    async def decode_version(self) -> str | None:
        """D's vLLM release: the last one read, or ``GET /version`` now if none was."""
        if self._version is None:
            async with self._lock:
                if self._version is None:
                    read = await read_version(self._upstream)
                    self._version = read.version
                    self._on_version(read)
                    self._publish()
        return self._version

    async def _read_info(self, started: float) -> None:
        read = await read_version(self._upstream)
        kv_answered, kv = await read_kv_connector(self._upstream)
        self._version = read.version or self._version
        self._on_version(read)
        if kv_answered:
            self._note_kv(kv)
        if read.answered and kv_answered:
            self._info_due = started + INFO_MAX_AGE

    def _note_kv(self, kv: bool | None) -> None:
        """Keep what /metrics showed; say so once per change (the first reading included)."""
        if kv == self._probed_kv and self._kv_read:
            return
        self._probed_kv, self._kv_read = kv, True
        if kv is False and self._setting != "no":
            log.warning(
                "D's /metrics shows no NIXL KV connector (no vllm:nixl_* families): D cannot release "
                "P's blocks itself, so the sidecar releases every rejection",
                extra={"decode_kv_connector": self._setting},
            )
        elif kv is None and self._setting == "auto":
            log.warning(
                "cannot tell whether D has a KV connector (its /metrics lists no vllm:num_requests_running:"
                " --disable-log-stats?); assuming it has one: set decode_kv_connector to yes or no"
            )
        elif kv is True and self._setting == "no":
            log.warning("decode_kv_connector is no, but D's /metrics shows a NIXL KV connector")

    def _kv(self) -> bool | None:
        return {"yes": True, "no": False}.get(self._setting, self._probed_kv)

    def _publish(self) -> None:
        old = self._view
        faulted = self._clock() < self._faulted_until
        new = DecodeView(self._engine, self._draining or self._exiting, self._kv(), self._version, faulted)
        if new == old:
            return
        self._view = new
        if new.can_notify != old.can_notify:
            if new.can_notify:
                log.info("D can release P's blocks itself", extra={"decode": _fields(new)})
            else:
                # This pod's own SIGTERM is expected: said, not warned about.
                level = logging.INFO if self._draining else logging.WARNING
                log.log(
                    level,
                    "D cannot release P's blocks itself (%s): the sidecar releases the rejections "
                    "D would have released",
                    new.reason,
                    extra={"decode": _fields(new)},
                )

    async def _poll_forever(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self._interval)
            self._wake.clear()
            try:
                await self.refresh()
            except Exception:  # a bug must not stop the poller: the view goes to "unknown"
                log.exception("probing D failed")
                self._engine, self._engine_at = "unknown", self._clock()
                self._publish()


def _fields(view: DecodeView) -> dict[str, object]:
    return {
        "engine": view.engine,
        "shutting_down": view.shutting_down,
        "kv_connector": view.kv_connector,
        "version": view.version,
    }
