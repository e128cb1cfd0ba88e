"""Logging set-up: one JSON object per line (or plain text), fields from ``extra``.

Everything the process logs goes through the one handler ``setup`` installs:
the sidecar's own loggers, uvicorn's (its start and stop lines once each, not
once per server; its access log only with ``access_log``), and NIXL's Python
loggers once NIXL is imported (``adopt``), which otherwise print their own
text lines to stdout. No ANSI escapes: uvicorn's ``color_message`` is dropped.
NIXL's C++ library logs through glog to stderr on its own, not through Python
(``NIXL_LOG_LEVEL`` sets how much).
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

import msgspec

_STANDARD = set(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {"message", "asctime"}
_SKIPPED = _STANDARD | {"color_message"}  # uvicorn's copy of the message, with ANSI colours
_ENCODER = msgspec.json.Encoder()
#: uvicorn's server lifecycle lines, logged by each of the sidecar's servers: said once.
LIFECYCLE = ("Started server process", "Shutting down", "Finished server process", "Waiting for")
_ACCESS_FIELDS = ("client", "method", "path", "http_version", "status")


def _extra(record: logging.LogRecord) -> dict[str, Any]:
    fields = {k: v for k, v in record.__dict__.items() if k not in _SKIPPED and not k.startswith("_")}
    if record.name == "uvicorn.access" and isinstance(record.args, tuple) and len(record.args) == 5:
        fields.update(zip(_ACCESS_FIELDS, record.args, strict=True))
    return fields


class JSONFormatter(logging.Formatter):
    """``{"ts", "level", "logger", "msg", ...extra}``; never raises on odd values."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
            **_extra(record),
        }
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        try:
            return _ENCODER.encode(entry).decode()
        except (TypeError, msgspec.EncodeError):
            return _ENCODER.encode({k: str(v) for k, v in entry.items()}).decode()


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        extra = " ".join(f"{k}={v}" for k, v in _extra(record).items())
        base = f"{record.levelname.lower():7} {record.name}: {record.getMessage()}"
        return f"{base} {extra}".rstrip()


class _Once(logging.Filter):
    """Lets each of uvicorn's lifecycle lines through once (every server logs them)."""

    def __init__(self) -> None:
        super().__init__()
        self._seen: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if not message.startswith(LIFECYCLE):
            return True
        if message in self._seen:
            return False
        self._seen.add(message)
        return True


def setup(level: str, fmt: str, access_log: bool = False) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JSONFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logging.getLogger(name).handlers[:] = []
        logging.getLogger(name).propagate = True
    logging.getLogger("uvicorn.error").filters[:] = [_Once()]
    logging.getLogger("uvicorn.access").disabled = not access_log
    adopt("nixl")


def adopt(name: str) -> None:
    """Route logger ``name`` (a library that installs its own handlers) through the root handler."""
    logger = logging.getLogger(name)
    logger.handlers[:] = []
    logger.propagate = True
