"""How the fault checks name a task on the sidecar's loop (shared with the sidecar process they run)."""

from __future__ import annotations

import asyncio
import re
from typing import Any


def task_kind(task: asyncio.Task[Any]) -> str:
    """What a task runs (its coroutine's qualified name), with its name when it was given one.

    Tasks are compared by kind, not by identity: a long-lived task the sidecar replaces with
    another of its kind (a worker waiting on an event) is not a leak, while a task of a kind the
    baseline did not have, or one more of a kind, is."""
    coro = task.get_coro()
    what = getattr(coro, "__qualname__", type(coro).__name__)
    name = task.get_name()
    return what if re.fullmatch(r"Task-\d+", name) else f"{name}:{what}"
