"""Polling: wait ``until`` something holds, never sleep on a guess.

``until`` polls a check from a thread, ``until_async`` from a coroutine (the state another thread
or task changes); both share one deadline and one failure message. ``answered`` polls a URL until
it answers a status, e.g. a child process's readiness.
"""

from __future__ import annotations

import asyncio
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import httpx

T = TypeVar("T")


class _Deadline:
    """``timeout`` seconds from now; past it, fail naming what was waited for and, given
    ``state``, what holds instead."""

    def __init__(self, what: str, timeout: float, state: Callable[[], object] | None) -> None:
        self.what, self.state = what, state
        self.at = time.monotonic() + timeout

    def passed(self, fail: bool) -> bool:
        if time.monotonic() <= self.at:
            return False
        if fail:
            found = f": {self.state()}" if self.state else ""
            raise AssertionError(f"timed out waiting for {self.what}{found}")
        return True


def until(
    check: Callable[[], T],
    what: str = "the condition",
    timeout: float = 10.0,
    poll: float = 0.01,
    state: Callable[[], object] | None = None,
    *,
    fail: bool = True,
) -> T:
    """Poll ``check`` every ``poll`` seconds until it returns a true value, and return that value.

    After ``timeout`` seconds (a bound for a hang, not a measure) fail naming ``what`` and
    ``state()``; with ``fail=False`` return the last value instead (for a caller that asserts on it).
    """
    deadline = _Deadline(what, timeout, state)
    while not (value := check()) and not deadline.passed(fail):
        time.sleep(poll)
    return value


async def until_async(
    check: Callable[[], T],
    what: str = "the condition",
    timeout: float = 10.0,  # noqa: ASYNC109 - the bound of a poll, as in ``until``
    poll: float = 0.01,
    state: Callable[[], object] | None = None,
    *,
    fail: bool = True,
) -> T:
    """``until`` on the running event loop: the loop runs on while it waits."""
    deadline = _Deadline(what, timeout, state)
    while not (value := check()) and not deadline.passed(fail):  # noqa: ASYNC110 - polled state has no event
        await asyncio.sleep(poll)
    return value


def answered(
    url: str,
    status: int = 200,
    timeout: float = 20.0,
    poll: float = 0.02,
    process: subprocess.Popen[Any] | None = None,
    log: Path | None = None,
    **client: Any,
) -> httpx.Response:
    """Poll ``GET url`` until it answers ``status`` (a connection refused or cut is polled again);
    that answer. ``process``: the child serving ``url``, whose exit fails the wait at once;
    ``log``: its output, whose end a failure shows; ``client``: more arguments for ``httpx.get``
    (``verify``, ``headers``). One answer may take up to 5 s (a loaded machine), all ``timeout``."""
    last: list[object] = ["no answer"]

    def answer() -> tuple[httpx.Response] | None:
        if process is not None and process.poll() is not None:
            raise AssertionError(
                f"{process.args!r} exited {process.returncode} before {url} answered{tail()}"
            )
        try:
            response = httpx.get(url, timeout=min(5.0, timeout), **client)
        except httpx.TransportError as exc:
            last[0] = exc
            return None
        last[0] = response.status_code
        return (response,) if response.status_code == status else None

    def tail() -> str:
        return f"\n{log.read_text(errors='replace')[-3000:]}" if log is not None else ""

    found = until(answer, f"{url} to answer {status}", timeout, poll, lambda: f"last: {last[0]!r}{tail()}")
    assert found is not None
    return found[0]
