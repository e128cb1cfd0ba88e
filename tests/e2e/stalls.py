"""When, and how long, the machine stalled during a scenario, measured by the harness itself.

On a shared machine with a few cores every process can stall for seconds
(seen here: P, D, the sidecars and the harness all silent for 15 s at once),
long enough for P's lease to run out with nothing wrong in the system under
test. ``StallWatch`` records two kinds of stall, each as an interval of
``time.monotonic()``: a gap between the ticks of a thread that only sleeps
(the harness not running), and a slow answer of P's ``/metrics`` (P's server
not running; it is a constant, cheap request). ``longest_within`` is the
longest of those overlapping a given window: the runner asks it about each
scenario's release window (from P's pin to its lease's end), and
``tests.e2e.verdict.retry_allowed`` reruns a scenario whose only faults are
about time only when that stall is at least ``STALL`` seconds.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass

#: A stall at least this long (seconds) inside the release window lets a timing failure run again.
STALL = 2.0
#: Stalls shorter than this are not kept (they explain nothing; the ticking thread sees many).
KEPT = 0.5


@dataclass(frozen=True)
class Stall:
    """One stall: from ``start`` to ``end`` (``time.monotonic()``), seen by ``source``."""

    start: float
    end: float
    source: str  # "harness" (the ticking thread) or "P /metrics" (a slow answer)

    @property
    def seconds(self) -> float:
        return self.end - self.start

    def overlap(self, start: float, end: float) -> float:
        """The seconds of this stall inside ``[start, end]``."""
        return max(0.0, min(self.end, end) - max(self.start, start))


class StallWatch:
    """Stalls seen while running (a context manager running the ticking thread)."""

    def __init__(self, tick: float = 0.1, keep: int = 10_000) -> None:
        self.tick = tick
        self._stalls: deque[Stall] = deque(maxlen=keep)
        self._worst = 0.0
        self._worst_gap = 0.0  # the harness's own (the ticking thread's)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stall-watch", daemon=True)

    def _run(self) -> None:
        last = time.monotonic()
        while not self._stop.wait(self.tick):
            now = time.monotonic()
            start = last + self.tick
            self.note(start, now, "harness")
            with self._lock:
                self._worst_gap = max(self._worst_gap, now - start)
            last = now

    def note(self, start: float, end: float, source: str = "P /metrics") -> None:
        """A stall (or a call that took long) from ``start`` to ``end``."""
        seconds = end - start
        with self._lock:
            self._worst = max(self._worst, seconds)
            if seconds >= KEPT:
                self._stalls.append(Stall(start, end, source))

    def longest_within(self, start: float, end: float) -> float:
        """The longest part of one stall inside ``[start, end]``, in seconds (0 when none)."""
        with self._lock:
            return max((stall.overlap(start, end) for stall in self._stalls), default=0.0)

    def reset(self) -> None:
        """Start a new scenario's worst figures (the recorded intervals stay)."""
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
