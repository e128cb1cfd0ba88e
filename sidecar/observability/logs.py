"""Logging set-up: one JSON object per line (or plain text), fields from ``extra``."""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

import msgspec

_STANDARD = set(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {"message", "asctime"}
_ENCODER = msgspec.json.Encoder()


class JSONFormatter(logging.Formatter):
    """``{"ts", "level", "logger", "msg", ...extra}``; never raises on odd values."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in record.__dict__.items():
            if key not in _STANDARD and not key.startswith("_"):
                entry[key] = value
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        try:
            return _ENCODER.encode(entry).decode()
        except (TypeError, msgspec.EncodeError):
            return _ENCODER.encode({k: str(v) for k, v in entry.items()}).decode()


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        extra = " ".join(
            f"{k}={v}" for k, v in record.__dict__.items() if k not in _STANDARD and not k.startswith("_")
        )
        base = f"{record.levelname.lower():7} {record.name}: {record.getMessage()}"
        return f"{base} {extra}".rstrip()


def setup(level: str, fmt: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JSONFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error"):
        logging.getLogger(name).handlers[:] = []
        logging.getLogger(name).propagate = True
    logging.getLogger("uvicorn.access").disabled = True
