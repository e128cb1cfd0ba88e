"""The simulators as the tests drive them: P's ``/stats``, its record of every block, read and
waited on (P's record is the ground truth of what was freed, and by whom)."""

from __future__ import annotations

from typing import Any, Protocol

import httpx

from tests.support.until import until


class Served(Protocol):
    """Where a simulator answers HTTP (a ``ServerThread``, or a child process's address)."""

    @property
    def url(self) -> str: ...


def _url(p: Served | str) -> str:
    return p if isinstance(p, str) else p.url


def p_stats(p: Served | str, **client: Any) -> dict[str, Any]:
    """P's ``/stats`` (``p``: its server or base URL; ``client``: ``verify`` for TLS)."""
    result: dict[str, Any] = httpx.get(_url(p) + "/stats", timeout=5, **client).json()
    return result


def wait_stats(
    p: Served | str, check: Any, timeout: float = 30.0, poll: float = 0.01, **client: Any
) -> dict[str, Any]:
    """P's stats once ``check(stats)`` holds. ``timeout`` bounds a hang, it measures nothing: at
    load 14 on two cores a sent notification took over 10 s to be counted by P's NIXL agent."""
    seen: list[dict[str, Any]] = [{}]

    def current() -> dict[str, Any] | None:
        seen[0] = p_stats(p, **client)
        return seen[0] if check(seen[0]) else None

    found = until(current, "P's expected state", timeout, poll, state=lambda: seen[0])
    assert found is not None
    return found
