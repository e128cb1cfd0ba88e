"""The decode simulator's one frozen config and its command-line flags.

``DecodeSimConfig`` holds every knob of ``kv-release-sidecar sim-decode``;
each field ``a_b`` is the flag ``--a-b`` (``disabled_routes`` is the
repeatable ``--disabled-route``). Validation happens when the Struct is
built: a bad value raises ``sidecar.config.ConfigError`` naming the field,
the value and the reason, before any socket opens.
"""

from __future__ import annotations

import argparse
from typing import Literal, get_args

import msgspec

from sidecar.config import ConfigError

FailOrigin = Literal["pre_handler", "handler"]
#: D's engine (``sidecar.sim.decode.engine``): running, dead, or shutting down after SIGTERM.
EngineMode = Literal["alive", "dead", "shutting_down", "faulted"]

#: The model both simulators serve unless told otherwise.
DEFAULT_MODEL = "sim-model"

#: The completion routes vLLM wraps with its rejection cleanup (0.21.0+).
COMPLETION_ROUTES = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/responses",
    "/v1/messages",
    "/inference/v1/generate",
)


class DecodeSimConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Every knob of the decode simulator. Field ``a_b`` is flag ``--a-b``."""

    host: str = "127.0.0.1"
    port: int = 8200
    # The one model name served; sim-prefill's default is the same, so P and D agree unflagged.
    model: str = DEFAULT_MODEL
    version: str = "0.34.0"
    max_model_len: int = 4096
    # Tokens in every answer: one SSE event each (chat, completions) or one delta each (responses).
    stream_events: int = 8
    # Seconds between two SSE events; the first event is not delayed.
    event_delay: float = 0.0
    # Seconds spent in the handler before any handler decision (client may leave meanwhile).
    latency: float = 0.0
    # The first ``fail_first`` completion requests are answered ``fail_status``.
    fail_first: int = 0
    fail_status: int = 503
    fail_origin: FailOrigin = "pre_handler"
    # Every completion request hangs in the handler until the client leaves.
    hang: bool = False
    # Every stream is cut (connection aborted) after ``drop_after`` events.
    drop_mid_stream: bool = False
    drop_after: int = 2
    # vLLM 0.29.0+ admission control (``--max-num-queued-reqs``); 0 turns it off.
    max_concurrency: int = 0
    # ``--api-key``: requests to /v1/* need ``Authorization: Bearer <api_key>``.
    api_key: str | None = None
    # Elastic-EP scaling in progress: the scaling middleware answers 503 to everything.
    scaling: bool = False
    # Completion routes the model does not serve (501 before the handler, vLLM 0.33.0).
    disabled_routes: tuple[str, ...] = ()
    # ``--enable-prompt-tokens-details``: usage carries ``prompt_tokens_details``.
    prompt_tokens_details: bool = False
    # Entries kept in the /sim/log ring (about 200 bytes each without parameters).
    log_size: int = 10_000
    # Record each request's kv_transfer_params in /sim/log (tests that check them); off by default,
    # since P's block lists make a long run's log large.
    log_params: bool = False
    # "vLLM D" mode: notify P over NIXL for admitted requests (and, 0.21.0+, handler rejections).
    vllm_d: bool = False
    # D's engine at start (POST /sim/engine switches it): alive, dead, shutting_down or faulted.
    engine: EngineMode = "alive"
    # D was started with --kv-transfer-config (a KV connector): False never notifies P.
    kv_connector: bool = True
    # vLLM's stat loggers (--disable-log-stats turns them off): without them /metrics has no vllm:*.
    log_stats: bool = True

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ConfigError("port", self.port, "must be a TCP port between 0 and 65535")
        for name in ("max_model_len", "stream_events", "log_size"):
            if getattr(self, name) < 1:
                raise ConfigError(name, getattr(self, name), "must be at least 1")
        for name in ("event_delay", "latency", "fail_first", "drop_after", "max_concurrency"):
            if getattr(self, name) < 0:
                raise ConfigError(name, getattr(self, name), "must not be negative")
        if not 400 <= self.fail_status <= 599:
            raise ConfigError("fail_status", self.fail_status, "must be a 4xx or 5xx status")
        if not self.model:
            raise ConfigError("model", self.model, "must not be empty")
        if self.engine not in get_args(EngineMode):
            raise ConfigError("engine", self.engine, f"must be one of {', '.join(get_args(EngineMode))}")
        for route in self.disabled_routes:
            if route not in COMPLETION_ROUTES:
                raise ConfigError("disabled_routes", route, f"must be one of {', '.join(COMPLETION_ROUTES)}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add one flag per ``DecodeSimConfig`` field; unset flags keep the field default."""
    add = parser.add_argument
    add("--host", help="address to bind (default 127.0.0.1)")
    add("--port", type=int, help="port to bind (default 8200)")
    add(
        "--model",
        "--served-model",  # the flag's former name, kept as an alias
        dest="model",
        help=f"the only model name served (default {DEFAULT_MODEL}, as sim-prefill's)",
    )
    add("--version", help="what GET /version reports (default 0.34.0)")
    add("--max-model-len", type=int, help="context length in words (default 4096)")
    add("--stream-events", type=int, help="tokens per answer, one SSE event each (default 8)")
    add("--event-delay", type=float, help="seconds between SSE events (default 0)")
    add("--latency", type=float, help="seconds in the handler before deciding (default 0)")
    add("--fail-first", type=int, help="answer the first N completion requests --fail-status")
    add("--fail-status", type=int, help="status for --fail-first (default 503)")
    add("--fail-origin", choices=["pre_handler", "handler"], help="where --fail-first happens")
    add("--hang", action="store_true", default=None, help="never answer completion requests")
    add("--drop-mid-stream", action="store_true", default=None, help="cut every stream")
    add("--drop-after", type=int, help="events sent before a stream is cut (default 2)")
    add("--max-concurrency", type=int, help="503 above this many unfinished requests (0 = off)")
    add("--api-key", help="require Authorization: Bearer <key> on /v1/*")
    add("--scaling", action="store_true", default=None, help="answer 503 as if scaling")
    add(
        "--disabled-route",
        dest="disabled_routes",
        action="append",
        choices=list(COMPLETION_ROUTES),
        help="a completion route the model does not serve (501); repeatable",
    )
    add(
        "--prompt-tokens-details",
        action="store_true",
        default=None,
        help="report usage.prompt_tokens_details",
    )
    add("--log-size", type=int, help="entries kept in GET /sim/log (default 10000)")
    add(
        "--log-params",
        action="store_true",
        default=None,
        help="record each request's kv_transfer_params in GET /sim/log (default off)",
    )
    add(
        "--vllm-d",
        action="store_true",
        default=None,
        help="free P's blocks over NIXL like vLLM's D (admitted requests; handler rejections on 0.21.0+)",
    )
    add(
        "--engine",
        choices=list(get_args(EngineMode)),
        help="D's engine at start: alive, dead (/health 503) or shutting_down (POST /sim/engine switches)",
    )
    add(
        "--no-kv-connector",
        dest="kv_connector",
        action="store_false",
        default=None,
        help="D has no KV connector: it never notifies P and /metrics lists no vllm:nixl_* family",
    )
    add(
        "--disable-log-stats",
        dest="log_stats",
        action="store_false",
        default=None,
        help="no vLLM stat loggers: /metrics lists no vllm:* family (as vLLM's flag)",
    )


def config_from_args(args: argparse.Namespace) -> DecodeSimConfig:
    """Build the config from parsed flags; flags left unset keep their defaults."""
    names = DecodeSimConfig.__struct_fields__
    given = {name: value for name, value in vars(args).items() if name in names}
    values = {name: value for name, value in given.items() if value is not None}
    if "disabled_routes" in values:
        values["disabled_routes"] = tuple(values["disabled_routes"])
    return DecodeSimConfig(**values)
