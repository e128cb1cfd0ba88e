"""Progress on stderr while a run goes: a bar redrawn in place on a terminal, else a plain
line every few seconds (logs, CI), or nothing.

``Tally`` is what the runner updates as flows end; ``Progress.run`` renders
it until cancelled, and ``finish`` ends the bar's line.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import TextIO

from sidecar.loadtest.config import ProgressMode

BAR_WIDTH = 24
BAR_INTERVAL = 0.2
LINE_INTERVAL = 2.0


@dataclass
class Tally:
    """Counts the runner keeps up to date; read by the progress display."""

    started: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)
    blocks_in_use: float | None = None
    blocks_total: float | None = None

    @property
    def done(self) -> int:
        return sum(self.outcomes.values())


class Progress:
    """Renders a ``Tally`` in the chosen mode (``auto``: a bar on a TTY, lines otherwise)."""

    def __init__(
        self, mode: ProgressMode, duration: float, max_requests: int, stream: TextIO | None = None
    ) -> None:
        self.stream = stream or sys.stderr
        tty = self.stream.isatty()
        self.mode = ("bar" if tty else "line") if mode == "auto" else mode
        self.duration, self.max_requests = duration, max_requests
        self._origin = time.monotonic()
        self._drawn = False

    def render(self, tally: Tally, elapsed: float) -> str:
        """One status text: elapsed time, flows, outcomes and P's blocks."""
        pool = (
            f"  P blocks {tally.blocks_in_use:.0f}/{tally.blocks_total:.0f}"
            if tally.blocks_in_use is not None and tally.blocks_total
            else ""
        )
        counts = tally.outcomes
        rejected = counts["rejected"] + counts["stream_rejected"]
        errors = counts["error"] + counts["incomplete"] + counts["p_failed"]
        return (
            f"t={elapsed:5.1f}s started {tally.started} done {tally.done} ok {counts['ok']} "
            f"rejected {rejected} P-refused {counts['p_refused']} errors {errors}" + pool
        )

    def _fraction(self, tally: Tally, elapsed: float) -> float:
        by_time = elapsed / self.duration
        by_count = tally.started / self.max_requests if self.max_requests else 0.0
        return min(1.0, max(by_time, by_count))

    def draw(self, tally: Tally) -> None:
        """Draw once (the bar in place, or one line)."""
        if self.mode == "off":
            return
        elapsed = time.monotonic() - self._origin
        text = self.render(tally, elapsed)
        if self.mode == "bar":
            filled = int(self._fraction(tally, elapsed) * BAR_WIDTH)
            bar = "#" * filled + "." * (BAR_WIDTH - filled)
            self.stream.write(f"\r[{bar}] {text}\x1b[K")
            self._drawn = True
        else:
            self.stream.write(f"loadtest: {text}\n")
        self.stream.flush()

    async def run(self, tally: Tally) -> None:
        """Draw every interval until cancelled."""
        if self.mode == "off":
            return
        interval = BAR_INTERVAL if self.mode == "bar" else LINE_INTERVAL
        while True:
            await asyncio.sleep(interval)
            self.draw(tally)

    def finish(self, tally: Tally) -> None:
        """A last draw, and end the bar's line."""
        if self.mode == "off":
            return
        self.draw(tally)
        if self._drawn:
            self.stream.write("\n")
            self.stream.flush()
