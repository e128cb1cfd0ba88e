"""What the invariant checker reads from the sidecar: decisions, errors, tasks, metrics, internals.

The sidecar runs either in this process (``InProcessView``: its logs reach a
``LogWatch`` handler, its loop is reached through ``ServerThread.call``) or as
a child process (``ProcessView``: its JSON log lines are read from a file,
its tasks from the debug port of ``tests.faults.sidecar_proc``). Both give the
same ``SidecarView``: the pipeline's "release decision" results per request
id, the errors that count as unhandled, the number of asyncio tasks on the
sidecar's loop, its admin ``/metrics`` and its configured bounds.

An error counts as unhandled when its traceback runs through the sidecar's
own code (``sidecar/`` outside ``sidecar/sim/``), or when a sidecar logger
logs at ERROR or above. One kind is deliberate and allowed: the proxy
re-raises ``UpstreamError`` from ``Forwarder.pump`` (or ``Forwarder._whole``, which
reads a small JSON answer whole before writing it) when D breaks a response whose
head was sent (or is then sent) to the client, so the server aborts the client's
connection too (the client must see a truncated answer, not a complete one).
"""

from __future__ import annotations

import asyncio
import json
import logging
import traceback
from collections import defaultdict
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Protocol

import httpx
from prometheus_client.parser import text_string_to_metric_families

from sidecar.config import Config
from tests.faults.taskkind import task_kind
from tests.support.runner import Sidecar

OWN_CODE = "/sidecar/"
SIM_CODE = "/sidecar/sim/"
#: (exception type name, function that raised it deliberately).
ALLOWED = {("UpstreamError", "pump"), ("UpstreamError", "_whole")}
SERVER_LOGGERS = ("asyncio", "uvicorn.error")


@dataclass(frozen=True)
class Bounds:
    """The sizes the sidecar promises to stay within (from its config)."""

    queue: int
    ledger: int
    engines: int
    release_ambiguous: bool
    release_deadline: float

    @classmethod
    def of(cls, config: Config) -> Bounds:
        return cls(
            queue=config.release_queue_size,
            ledger=config.ledger_size,
            engines=config.handshake_cache_size,
            release_ambiguous=config.release_ambiguous,
            release_deadline=config.release_deadline,
        )


def _frames(tb: TracebackType | None) -> list[tuple[str, str]]:
    return [(frame.filename, frame.name) for frame in traceback.extract_tb(tb)]


def is_own(frames: list[tuple[str, str]]) -> bool:
    return any(OWN_CODE in path and SIM_CODE not in path for path, _ in frames)


def is_allowed(exc: BaseException | None, frames: list[tuple[str, str]]) -> bool:
    names = {name for _, name in frames}
    return exc is not None and any(type(exc).__name__ == t and fn in names for t, fn in ALLOWED)


class LogWatch(logging.Handler):
    """Collects release decisions and unhandled errors from this process's loggers."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.decisions: dict[str, list[str]] = defaultdict(list)
        self.unhandled: list[str] = []
        self.aborted_streams = 0  # deliberate: D broke a response already started
        self.sim_errors: list[str] = []  # the simulators' own errors (not the sidecar's)

    def emit(self, record: logging.LogRecord) -> None:
        if record.name == "sidecar.release" and record.getMessage() == "release decision":
            # Copies: keeping the sidecar's own strings alive would count as *its* memory (test_memory).
            request_id = str(getattr(record, "request_id", "?")).encode().decode()
            self.decisions[request_id].append(str(getattr(record, "result", "?")).encode().decode())
            return
        if record.exc_info and record.exc_info[1] is not None:
            exc = record.exc_info[1]
            frames = _frames(record.exc_info[2])
            for cause in _chain(exc):
                frames += _frames(cause.__traceback__)
            text = f"{record.name}: {record.getMessage()}: {type(exc).__name__}: {exc}"
            if is_allowed(exc, frames):
                self.aborted_streams += 1
            elif is_own(frames) or (_own_logger(record.name) and record.levelno >= logging.ERROR):
                self.unhandled.append(text)
            else:
                self.sim_errors.append(text)
            return
        if record.levelno >= logging.ERROR and (_own_logger(record.name) or record.name in SERVER_LOGGERS):
            self.unhandled.append(f"{record.name}: {record.getMessage()}")


def _own_logger(name: str) -> bool:
    return (name == "sidecar" or name.startswith("sidecar.")) and not name.startswith("sidecar.sim")


def _chain(exc: BaseException) -> Iterator[BaseException]:
    seen = {id(exc)}
    current = exc.__cause__ or exc.__context__
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


@contextmanager
def watching() -> Iterator[LogWatch]:
    """Attach a ``LogWatch`` to the root logger and to uvicorn's (which does not propagate).

    Start it after the servers: each ``uvicorn.Config`` re-applies uvicorn's logging config.
    Release decisions are logged at INFO, so that logger is opened to INFO meanwhile.
    """
    watch = LogWatch()
    targets = [logging.getLogger(), logging.getLogger("uvicorn")]
    release = logging.getLogger("sidecar.release")
    old_level = release.level
    release.setLevel(logging.INFO)
    for logger in targets:
        logger.addHandler(watch)
    try:
        yield watch
    finally:
        for logger in targets:
            logger.removeHandler(watch)
        release.setLevel(old_level)


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> ``{"name{label=value,...}": value}`` (labels sorted)."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            out[f"{sample.name}{{{labels}}}" if labels else sample.name] = float(sample.value)
    return out


def total(metrics: Mapping[str, float], name: str, **labels: str) -> float:
    """Sum of ``name``'s samples whose labels include ``labels``."""
    wanted = [f"{k}={v}" for k, v in labels.items()]
    found = 0.0
    for key, value in metrics.items():
        base, _, rest = key.partition("{")
        if base == name and all(w in rest.rstrip("}").split(",") for w in wanted):
            found += value
    return found


class SidecarView(Protocol):
    """What the checker needs from a running sidecar."""

    bounds: Bounds

    def decisions(self) -> Mapping[str, list[str]]: ...
    def unhandled(self) -> list[str]: ...
    def tasks(self) -> tuple[int, list[str]]: ...
    def metrics(self) -> dict[str, float]: ...
    def internals(self) -> dict[str, int]: ...


async def _tasks() -> tuple[int, list[str]]:
    current = asyncio.current_task()
    others = [t for t in asyncio.all_tasks() if t is not current]
    return len(others), sorted(task_kind(t) for t in others)


class InProcessView:
    """A sidecar from ``tests.support.runner.run_sidecar`` with a ``LogWatch``."""

    def __init__(self, sc: Sidecar, watch: LogWatch) -> None:
        self.sc, self.watch = sc, watch
        self.bounds = Bounds.of(sc.app.config)

    def decisions(self) -> Mapping[str, list[str]]:
        return self.watch.decisions

    def unhandled(self) -> list[str]:
        return list(self.watch.unhandled)

    def tasks(self) -> tuple[int, list[str]]:
        result: tuple[int, list[str]] = self.sc.server.call(_tasks())
        return result

    def metrics(self) -> dict[str, float]:
        return parse_metrics(httpx.get(self.sc.admin_url + "/metrics", timeout=5).text)

    def internals(self) -> dict[str, int]:
        """Sizes the metrics do not show: retry progress, handshakes in flight, live keys."""
        runtime = self.sc.app.runtime
        assert runtime is not None
        releaser: Any = runtime.releaser
        return {
            "queue": runtime.pipeline.depth,
            "progress": len(getattr(releaser, "_progress", ())),
            "handshakes_in_flight": len(getattr(getattr(releaser, "session", None), "pending", ())),
            "inflight_live": len(runtime.inflight._live),
            "inflight_admitted": len(runtime.inflight._admitted),
            "live_jobs": runtime.pipeline.live,
            "targets": len(runtime.pipeline.targets),
        }


class ProcessView:
    """A sidecar child process (``tests.faults.sidecar_proc``): JSON log file and debug port."""

    def __init__(self, admin_url: str, debug_url: str, log_path: Path, bounds: Bounds) -> None:
        self.admin_url, self.debug_url, self.log_path, self.bounds = admin_url, debug_url, log_path, bounds
        self._decisions: dict[str, list[str]] = defaultdict(list)
        self._unhandled: list[str] = []
        self._offset = 0
        self.aborted_streams = 0

    def _read_log(self) -> None:
        with self.log_path.open("rb") as handle:
            handle.seek(self._offset)
            data = handle.read()
        end = data.rfind(b"\n") + 1
        self._offset += end
        for line in data[:end].splitlines():
            self._line(line)

    def _line(self, line: bytes) -> None:
        try:
            entry = json.loads(line)
        except ValueError:
            return  # NIXL's own C++ log lines share stderr
        if entry.get("msg") == "release decision":
            self._decisions[str(entry.get("request_id"))].append(str(entry.get("result")))
            return
        exc = str(entry.get("exc", ""))
        deliberate = "UpstreamError" in exc and ("in pump\n" in exc or "in _whole\n" in exc)
        if deliberate:
            self.aborted_streams += 1
        elif exc or (entry.get("level") in ("error", "critical") and entry.get("logger") != "sidecar.sim"):
            self._unhandled.append(f"{entry.get('logger')}: {entry.get('msg')}: {exc[-300:]}")

    def decisions(self) -> Mapping[str, list[str]]:
        self._read_log()
        return self._decisions

    def unhandled(self) -> list[str]:
        self._read_log()
        return list(self._unhandled)

    def tasks(self) -> tuple[int, list[str]]:
        data = httpx.get(self.debug_url + "/debug", timeout=5).json()
        return int(data["tasks"]), list(data["task_names"])

    def metrics(self) -> dict[str, float]:
        return parse_metrics(httpx.get(self.admin_url + "/metrics", timeout=5).text)

    def internals(self) -> dict[str, int]:
        data = httpx.get(self.debug_url + "/debug", timeout=5).json()
        return {k: int(v) for k, v in data["internals"].items()}
