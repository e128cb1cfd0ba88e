"""Where a hop's CPU goes under load: py-spy sampling the sidecar, summed by function.

``record`` runs ``py-spy record`` against a running process for the length of a
phase: 100 samples a second of the threads that are running (idle ones, asleep
in the event loop's poll, are left out, so the shares are of the CPU the
process used), ``--nonblocking`` so the sidecar is never paused, pinned to the
load core so its own CPU does not land on the hop's. ``summary`` reads the
collapsed stacks it wrote and gives the functions with the largest share of
samples, by self (the innermost frame: where the CPU was spent) and by total
(anywhere on the stack: what it was spent for).
"""

from __future__ import annotations

import asyncio
import shutil
import sys
from collections import Counter
from pathlib import Path

import msgspec

from bench.harness.procs import BenchError, child_setup

RATE = 100  # samples per second


class Profile(msgspec.Struct, kw_only=True):
    """A phase's profile: the top functions by self and by total share of the samples."""

    samples: int
    self_share: list[tuple[str, float]]
    total_share: list[tuple[str, float]]
    raw: str  # the collapsed stacks, for flame graphs


def find() -> str:
    beside = Path(sys.executable).with_name("py-spy")  # the environment's own, PATH or not
    found = str(beside) if beside.exists() else shutil.which("py-spy")
    if found is None:
        raise BenchError("--profile needs py-spy (pip install py-spy; make's environment has it)")
    return found


async def record(pid: int, seconds: float, out: Path, cpus: frozenset[int]) -> asyncio.subprocess.Process:
    """Start sampling ``pid`` for ``seconds`` into ``out`` (wait on the returned process)."""
    argv = [find(), "record", "--pid", str(pid), "--duration", str(max(1, round(seconds))), "--rate",
            str(RATE), "--nonblocking", "--format", "raw", "--output", str(out)]  # fmt: skip
    return await asyncio.create_subprocess_exec(
        *argv,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
        preexec_fn=child_setup(cpus),
    )


def summary(raw: Path, top: int = 15) -> Profile:
    """The ``top`` functions by self and by total share of the samples in py-spy's raw output."""
    own: Counter[str] = Counter()
    anywhere: Counter[str] = Counter()
    total = 0
    text = raw.read_text() if raw.exists() else ""
    for line in text.splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = [_short(frame) for frame in stack.split(";")]
        total += count
        own[frames[-1]] += count
        for frame in set(frames):
            anywhere[frame] += count
    share = 1 / total if total else 0.0
    return Profile(
        samples=total,
        self_share=[(name, n * share) for name, n in own.most_common(top)],
        total_share=[(name, n * share) for name, n in anywhere.most_common(top)],
        raw=str(raw),
    )


def _short(frame: str) -> str:
    """``function (path/to/module.py:12)`` as ``module.py:function``, the line left out."""
    function, _, where = frame.partition(" (")
    module = where.rsplit(":", 1)[0].rsplit("/", 1)[-1] if where else "?"
    return f"{module}:{function}"


def render(title: str, found: Profile, top: int = 12) -> list[str]:
    """``found`` as text lines: its top functions by self share, then by total share."""
    lines = ["", f"profile, {title}: {found.samples} samples ({found.raw})", "  self:"]
    lines += [f"    {share:6.1%}  {name}" for name, share in found.self_share[:top]]
    lines.append("  total (on the stack):")
    lines += [f"    {share:6.1%}  {name}" for name, share in found.total_share[:top]]
    return lines
