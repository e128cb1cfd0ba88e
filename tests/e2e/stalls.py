"""How long the machine stalled during a scenario, measured by the harness itself.

On a shared machine with a few cores every process can stall for seconds
(seen here: P, D, the sidecars and the harness all silent for 15 s at once),
long enough for P's lease to run out with nothing wrong in the system under
test. ``StallWatch`` measures two things per scenario: the longest gap
between the ticks of a thread that only sleeps (the harness not running),
and the slowest answer of P's ``/metrics`` (P's server not running; it is
a constant, cheap request). A scenario that fails during such a stall runs
again (three attempts at most), one whose only fault is that the expected
notification reached P after its lease (``tests.e2e.verdict.only_late``)
once more; the report keeps every failed attempt's verdict.
"""

from __future__ import annotations

import threading
import time

#: A stall at least this long (seconds) makes a failed scenario worth a second attempt.
STALL = 2.0


class StallWatch:
    """The worst stall seen since ``reset``; a context manager running the ticking thread."""

    def __init__(self, tick: float = 0.1) -> None:
        self.tick = tick
        self._worst = 0.0
        self._worst_gap = 0.0  # the harness's own (the ticking thread's)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stall-watch", daemon=True)

    def _run(self) -> None:
        last = time.monotonic()
        while not self._stop.wait(self.tick):
            now = time.monotonic()
            gap = now - last - self.tick
            self.note(gap)
            with self._lock:
                self._worst_gap = max(self._worst_gap, gap)
            last = now

    def note(self, seconds: float) -> None:
        """A stall (or a call's duration) of ``seconds``."""
        with self._lock:
            self._worst = max(self._worst, seconds)

    def reset(self) -> None:
        with self._lock:
            self._worst = self._worst_gap = 0.0

    @property
    def worst(self) -> float:
        with self._lock:
            return self._worst

    @property
    def worst_gap(self) -> float:
        """The harness's own longest stall (the rest of ``worst`` was P's ``/metrics`` answering late)."""
        with self._lock:
            return self._worst_gap

    def __enter__(self) -> StallWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(2)
