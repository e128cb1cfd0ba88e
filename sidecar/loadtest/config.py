"""The load generator's one frozen config and its command-line flags.

Field ``a_b`` is flag ``--a-b``; ``--stream`` is shorthand for
``--stream-share 1``. Validation happens when the Struct is built and names
the field, the value and the reason (``sidecar.config.ConfigError``), so a
bad flag stops the run before any request is sent.
"""

from __future__ import annotations

import argparse
from typing import Literal
from urllib.parse import urlsplit

import msgspec

from sidecar.config import ConfigError

Route = Literal["completions", "chat"]
ProgressMode = Literal["auto", "bar", "line", "off"]
ProbeMode = Literal["auto", "stats", "metrics"]

ROUTE_PATHS: dict[Route, str] = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


class LoadConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Every setting of ``kv-release-sidecar loadtest``."""

    prefill_url: str
    decode_url: str  # D itself, or the sidecar in front of it
    rate: float = 0.0  # Poisson arrivals per second (open loop); 0 = use concurrency
    concurrency: int = 0  # flows kept in flight; 0 = use rate
    duration: float = 10.0  # seconds of arrivals; the run always stops by itself
    max_requests: int = 0  # 0 = no limit besides the duration
    stream_share: float = 0.0  # share of decode legs with "stream": true
    route: Route = "completions"
    model: str = ""  # "" = the first model P lists at /v1/models
    block_size: int = 16
    max_prompt: int = 512  # longest prompt, in words (one word is one token in the simulators)
    max_tokens: int = 16
    seed: int = 0
    report: str = ""  # JSON report path
    plot: str = ""  # PNG path: P's pinned blocks and latency over time
    sidecar_admin_url: str = ""  # the sidecar's admin port, to read its release counters
    api_key: str = ""  # sent as "Authorization: Bearer <key>" on both legs
    sample_interval: float = 0.1  # seconds between two samples of P
    drain_timeout: float = 30.0  # after the last answer, wait this long for P to free its blocks
    # Before the run, wait up to this long for P's and D's /health (and the sidecar's /readyz):
    # in a cluster the Job starts with pods that take minutes to load a model. 0 = do not wait.
    ready_timeout: float = 0.0
    timeout: float = 120.0  # per leg
    max_inflight: int = 2048  # open loop, but bounded: arrivals beyond it are counted as dropped
    progress: ProgressMode = "auto"
    prefill_probe: ProbeMode = "auto"  # auto: the simulator's /stats when P serves it, else /metrics
    # D rejecting more than this share of what it is sent, for reasons not injected, fails the run:
    # a misconfiguration (model name, API key, limits) would otherwise pass with nothing tested.
    max_rejected_share: float = 0.1

    def __post_init__(self) -> None:
        for name in ("prefill_url", "decode_url", "sidecar_admin_url"):
            url = getattr(self, name)
            parts = urlsplit(url)
            if (url or name != "sidecar_admin_url") and (
                parts.scheme not in ("http", "https") or not parts.hostname
            ):
                raise ConfigError(name, url, "must be an http(s) URL with a host")
        if (self.rate > 0) == (self.concurrency > 0):
            raise ConfigError("rate", self.rate, "give exactly one of --rate and --concurrency")
        if self.rate < 0 or self.concurrency < 0:
            raise ConfigError("rate", self.rate, "must not be negative")
        for name in ("duration", "sample_interval", "timeout"):
            if getattr(self, name) <= 0:
                raise ConfigError(name, getattr(self, name), "must be greater than 0")
        for name in ("block_size", "max_prompt", "max_tokens", "max_inflight"):
            if getattr(self, name) < 1:
                raise ConfigError(name, getattr(self, name), "must be at least 1")
        if self.max_requests < 0 or self.drain_timeout < 0:
            raise ConfigError("max_requests", self.max_requests, "must not be negative")
        for name in ("stream_share", "max_rejected_share"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ConfigError(name, getattr(self, name), "must be between 0 and 1")

    @property
    def path(self) -> str:
        """The completion route both legs use."""
        return ROUTE_PATHS[self.route]


_HELP = {
    "prefill_url": "P's OpenAI server, e.g. http://127.0.0.1:8100",
    "decode_url": "D, or the sidecar in front of D, e.g. http://127.0.0.1:8000",
    "rate": "open-loop Poisson arrivals per second (this or --concurrency is required)",
    "concurrency": "closed loop: keep this many flows in flight (this or --rate is required)",
    "duration": "seconds of arrivals (default 10)",
    "max_requests": "stop after this many flows (default 0: no limit)",
    "stream_share": "share of decode legs that stream (default 0)",
    "route": "completion route of both legs (default completions)",
    "model": "model name (default: the first one P lists)",
    "block_size": "P's KV block size; some prompts are exact multiples of it (default 16)",
    "max_prompt": "longest prompt in words (default 512)",
    "max_tokens": "max_tokens of the decode leg (default 16)",
    "seed": "seed of arrivals and prompts (default 0)",
    "report": "write the JSON report here",
    "plot": "write a PNG of P's pinned blocks and latency over time here",
    "sidecar_admin_url": "the sidecar's admin URL, to read its release counters",
    "api_key": "bearer token for both legs",
    "sample_interval": "seconds between samples of P (default 0.1)",
    "drain_timeout": "seconds to wait at the end for P to free its blocks (default 30)",
    "ready_timeout": "seconds to wait first for P, D (and the sidecar) to be ready (default 0: no wait)",
    "timeout": "seconds per leg (default 120)",
    "max_inflight": "flows in flight at most; later arrivals are dropped and counted (default 2048)",
    "progress": "progress on stderr: auto (a bar on a TTY, lines otherwise), bar, line, off",
    "prefill_probe": "how to read P: auto (the simulator's /stats if served), stats, metrics (Prometheus)",
    "max_rejected_share": "fail when D rejects more than this share, injected ones aside (default 0.1)",
}
_INTS = ("concurrency", "max_requests", "block_size", "max_prompt", "max_tokens", "seed", "max_inflight")
_FLOATS = (
    *("rate", "duration", "stream_share", "sample_interval", "drain_timeout", "ready_timeout", "timeout"),
    "max_rejected_share",
)
_TYPES: dict[str, type] = {**dict.fromkeys(_INTS, int), **dict.fromkeys(_FLOATS, float)}
_CHOICES = {
    "route": ["completions", "chat"],
    "progress": ["auto", "bar", "line", "off"],
    "prefill_probe": ["auto", "stats", "metrics"],
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per config field, plus ``--stream``; unset flags keep the defaults. One of
    ``--rate`` and ``--concurrency`` is required (argparse says so, naming both)."""
    load = parser.add_mutually_exclusive_group(required=True)
    for field in msgspec.structs.fields(LoadConfig):
        required = field.name in ("prefill_url", "decode_url")
        (load if field.name in ("rate", "concurrency") else parser).add_argument(
            "--" + field.name.replace("_", "-"),
            dest=field.name,
            type=_TYPES.get(field.name, str),
            choices=_CHOICES.get(field.name),
            required=required,
            default=None,
            help=_HELP[field.name],
        )
    parser.add_argument("--stream", action="store_true", help="every decode leg streams (--stream-share 1)")


def config_from_args(args: argparse.Namespace) -> LoadConfig:
    """Build the config from parsed flags; raises ``ConfigError``."""
    names = {field.name for field in msgspec.structs.fields(LoadConfig)}
    given = {k: v for k, v in vars(args).items() if k in names and v is not None}
    if getattr(args, "stream", False):
        given["stream_share"] = 1.0
    try:
        return msgspec.convert(given, LoadConfig)
    except msgspec.ValidationError as exc:
        raise ConfigError("?", given, str(exc)) from exc
