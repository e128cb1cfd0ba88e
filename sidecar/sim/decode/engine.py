"""The simulated D's engine: alive, dead, shutting down or faulted, with or without a KV connector.

One ``EngineState`` per app, set from ``--engine`` / ``--no-kv-connector`` and
switched at run time with ``POST /sim/engine`` (``{"engine": "dead"}``,
``{"kv_connector": false}``; ``GET`` reads it). What each state looks like
from outside, as vLLM 0.21.0-0.33.0 does it (``sidecar.decode.state`` holds
the evidence):

* ``dead``: ``/health`` answers 503. A completion request still gets its
  model check (404), then 500 ``InternalServerError`` with ``EngineDeadError``'s
  client message (0.33.0: ``CLIENT_MESSAGE``; before: ``str(exc)``), streams
  included (the check runs before the 200). D's own notify fails
  (``ensure_alive``), so P is never notified.
* ``shutting_down``: the engine core drops every new request, the notify
  included. ``/health`` stays 200. Rejections are answered as usual; a request
  that passes every check is aborted by the engine: 200 with no tokens and
  ``finish_reason`` ``"abort"`` (on ``/v1/responses`` the simulator answers an
  empty incomplete response). Up to 0.27.x uvicorn's own SIGTERM handler also
  runs, so every answer carries ``Connection: close``; from 0.28.0 nothing shows.
* ``faulted`` (vLLM 0.34.0 with ``--enable-fault-tolerance``): the engine core
  faulted and awaits recovery. ``/health`` stays 200. A completion request gets
  its model check, then 503 ``EngineFaultedError`` (type "Service
  Unavailable"), streams included (``_preflight`` runs before the 200). D's own
  notification joins the faulted engine core's loop and does not reach P.
* ``kv_connector`` false: D was started without ``--kv-transfer-config``: it
  ignores ``kv_transfer_params`` (no notification, ever) and ``/metrics`` lists
  no ``vllm:nixl_*`` family.
"""

from __future__ import annotations

from typing import Any, get_args

import msgspec
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from sidecar.nixl.versions import parse_version
from sidecar.sim.decode.config import DecodeSimConfig, EngineMode
from sidecar.sim.decode.rules import Rejection
from sidecar.wire import error_body

ENGINE_MODES: tuple[str, ...] = get_args(EngineMode)
#: vLLM keeps its HTTP server up during the engine's shutdown from here (``NoSignalServer``).
NO_SIGNAL_SERVER = (0, 28, 0)
#: ``EngineDeadError.CLIENT_MESSAGE`` is what clients get from here; ``str(exc)`` before.
CLIENT_MESSAGE_SINCE = (0, 33, 0)
ENGINE_DEAD_MESSAGE = "EngineCore encountered an issue. See stack trace (above) for the root cause."
CLIENT_MESSAGE = "The server had an error while processing your request."
#: ``EngineFaultedError``'s message (vLLM 0.34.0, ``vllm/exceptions.py``), a GracefulHTTPError.
ENGINE_FAULTED_MESSAGE = (
    "The engine has faulted and cannot accept new requests. "
    "Please try again later or on a different instance."
)


class EngineState:
    """The engine mode and KV connector of one simulator app (mutable at run time)."""

    def __init__(self, config: DecodeSimConfig) -> None:
        self.mode: str = config.engine
        self.kv_connector = config.kv_connector
        parsed = parse_version(config.version)
        self.release = parsed.release if parsed is not None else (1 << 30, 0, 0)
        message = CLIENT_MESSAGE if self.release >= CLIENT_MESSAGE_SINCE else ENGINE_DEAD_MESSAGE
        self._dead = Rejection(500, error_body(message, 500, "InternalServerError"), "handler")
        self._faulted = Rejection(
            503, error_body(ENGINE_FAULTED_MESSAGE, 503, "Service Unavailable"), "handler"
        )

    @property
    def notifies(self) -> bool:
        """Whether D's own notifications (admitted reads, handler rejections) reach P."""
        return self.mode == "alive" and self.kv_connector

    @property
    def closing(self) -> bool:
        """Whether answers carry ``Connection: close`` (uvicorn exiting, vLLM before 0.28.0)."""
        return self.mode == "shutting_down" and self.release < NO_SIGNAL_SERVER

    def dead_rejection(self) -> Rejection | None:
        """The 500 a dead engine's handler answers after the model check; None when alive."""
        return self._dead if self.mode == "dead" else None

    def faulted_rejection(self) -> Rejection | None:
        """The 503 a faulted engine's admission check answers after the model check; None otherwise."""
        return self._faulted if self.mode == "faulted" else None

    def as_dict(self) -> dict[str, Any]:
        return {"engine": self.mode, "kv_connector": self.kv_connector}

    def update(self, change: Any) -> str:
        """Apply ``{"engine": ..., "kv_connector": ...}`` (either key); the error, or ""."""
        if not isinstance(change, dict) or not change.keys() <= {"engine", "kv_connector"}:
            return 'expected {"engine": ..., "kv_connector": ...}'
        mode, connector = change.get("engine", self.mode), change.get("kv_connector", self.kv_connector)
        if mode not in ENGINE_MODES:
            return f"engine must be one of {', '.join(ENGINE_MODES)}"
        if not isinstance(connector, bool):
            return "kv_connector must be true or false"
        self.mode, self.kv_connector = mode, connector
        return ""


def engine_routes(engine: EngineState) -> list[Route]:
    """``GET /sim/engine`` reads the state, ``POST /sim/engine`` changes it."""

    async def read(request: Request) -> Response:
        return JSONResponse(engine.as_dict())

    async def change(request: Request) -> Response:
        try:
            error = engine.update(msgspec.json.decode(await request.body()))
        except msgspec.DecodeError:
            error = "the body is not JSON"
        if error:
            return JSONResponse({"detail": error}, 400)
        return JSONResponse(engine.as_dict())

    return [Route("/sim/engine", read), Route("/sim/engine", change, methods=["POST"])]


def nixl_metrics(model: str) -> list[str]:
    """A few of the ``vllm:nixl_*`` families vLLM's NIXL connector registers at start-up."""
    labels = f'engine="0",model_name="{model}"'
    return [
        "# HELP vllm:nixl_xfer_time_seconds Histogram of transfer duration for NIXL KV Cache transfers.",
        "# TYPE vllm:nixl_xfer_time_seconds histogram",
        f'vllm:nixl_xfer_time_seconds_bucket{{{labels},le="+Inf"}} 0.0',
        f"vllm:nixl_xfer_time_seconds_count{{{labels}}} 0.0",
        f"vllm:nixl_xfer_time_seconds_sum{{{labels}}} 0.0",
        "# HELP vllm:nixl_num_failed_transfers Number of failed NIXL KV Cache transfers.",
        "# TYPE vllm:nixl_num_failed_transfers counter",
        f"vllm:nixl_num_failed_transfers_total{{{labels}}} 0.0",
    ]
