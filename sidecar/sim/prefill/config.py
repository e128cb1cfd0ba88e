"""The simulated prefill node's one frozen config and its command-line flags.

Field ``a_b`` is flag ``--a-b``. ``None`` means "what the chosen vLLM release
does": the lease defaults to the release's timeout (30 s from 0.22.0, 480 s
for 0.11.1-0.21.x, 120 s for 0.10.0-0.11.0, none before) and the side-channel port
to ``VLLM_NIXL_SIDE_CHANNEL_PORT``'s default (5557 up to 0.11.0, 5600 after);
a side-channel port of 0 picks a free one. Validation errors name the field,
the value and the reason, before any socket or agent exists.
"""

from __future__ import annotations

import argparse
from typing import Any, Literal, get_args

import msgspec

from sidecar.config import ConfigError
from sidecar.sim.decode.config import DEFAULT_MODEL
from sidecar.sim.prefill.release import Release, UnsupportedVersion, release_for

LogLevel = Literal["debug", "info", "warning", "error"]


class PrefillSimConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Every setting of ``kv-release-sidecar sim-prefill``."""

    host: str = "127.0.0.1"
    port: int = 8100
    vllm_version: str = "0.34.0"
    tp: int = 1
    pp: int = 1
    engine_id: str = ""  # "" picks a random UUID at start, like vLLM's default
    model: str = DEFAULT_MODEL  # sim-decode's default too: the two work together unflagged
    num_blocks: int = 1024
    block_size: int = 16
    lease: float | None = None  # seconds; 0 = never expire; None = the release's default
    side_channel_host: str = "127.0.0.1"
    side_channel_port: int | None = None  # 0 = a free port; None = the release's default
    poll_interval: float = 0.001
    agent_start_timeout: float = 30.0
    latency: float = 0.0  # seconds between pinning the blocks and answering (the prefill's compute)
    log_level: LogLevel = "info"

    def __post_init__(self) -> None:
        try:
            release = release_for(self.vllm_version)
        except UnsupportedVersion as exc:
            raise ConfigError("vllm_version", self.vllm_version, str(exc)) from exc
        for name in ("tp", "pp", "num_blocks", "block_size"):
            if getattr(self, name) < 1:
                raise ConfigError(name, getattr(self, name), "must be at least 1")
        if self.pp > 1 and not release.supports_pp:
            reason = "PP needs vLLM 0.26.0+ (the handshake is keyed by TP rank alone before)"
            raise ConfigError("pp", self.pp, reason)
        if self.latency < 0:
            raise ConfigError("latency", self.latency, "must be 0 or positive")
        if self.lease is not None and self.lease < 0:
            raise ConfigError("lease", self.lease, "must be 0 (never) or positive")
        for name in ("poll_interval", "agent_start_timeout"):
            if getattr(self, name) <= 0:
                raise ConfigError(name, getattr(self, name), "must be greater than 0")
        self._check_ports(release)

    def _check_ports(self, release: Release) -> None:
        if not 0 <= self.port <= 65535:
            raise ConfigError("port", self.port, "must be a TCP port between 0 and 65535")
        port = self.side_channel_port
        listeners = 1 if release.scheduler_listener else self.tp
        if port is not None and not (port == 0 or 1 <= port <= 65536 - listeners):
            reason = f"must be 0 (free) or a base port leaving room for {listeners} listener(s)"
            raise ConfigError("side_channel_port", port, reason)

    @property
    def release(self) -> Release:
        """The behaviour table row of ``vllm_version``."""
        return release_for(self.vllm_version)

    @property
    def effective_lease(self) -> float | None:
        """Lease in seconds, or None when blocks wait for a notification forever."""
        lease = self.lease if self.lease is not None else self.release.default_lease
        return lease or None

    @property
    def effective_side_channel_port(self) -> int:
        """Base port to bind (0 = a free one)."""
        if self.side_channel_port is None:
            return self.release.default_side_channel_port
        return self.side_channel_port


_TYPES: dict[str, Any] = {
    "port": int,
    "tp": int,
    "pp": int,
    "num_blocks": int,
    "block_size": int,
    "lease": float,
    "side_channel_port": int,
    "poll_interval": float,
    "agent_start_timeout": float,
    "latency": float,
}
_HELP = {
    "vllm_version": "vLLM release whose wire format P speaks (0.9.0 - 0.34.x)",
    "tp": "tensor-parallel workers (one NIXL agent each)",
    "pp": "pipeline-parallel ranks (vLLM 0.26.0+)",
    "lease": "seconds before P frees un-notified blocks (0 = never)",
    "side_channel_port": "base side-channel port (0 = a free one)",
    "num_blocks": "usable KV blocks in P's pool",
    "block_size": "tokens per block",
    "latency": "seconds between pinning a prompt's blocks and answering (prefill compute time)",
    "model": "the model name served (sim-decode's default is the same)",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per config field; unset flags keep the config defaults."""
    for field in msgspec.structs.fields(PrefillSimConfig):
        flag = "--" + field.name.replace("_", "-")
        shown = "the release's" if field.default is None else repr(field.default)
        help_text = f"{_HELP.get(field.name, field.name.replace('_', ' '))} (default {shown})"
        choices = list(get_args(field.type)) if field.name == "log_level" else None
        parser.add_argument(
            flag,
            dest=field.name,
            type=_TYPES.get(field.name, str),
            choices=choices,
            default=None,
            help=help_text,
        )


def config_from_args(args: argparse.Namespace) -> PrefillSimConfig:
    """Build the config from parsed flags; raises ``ConfigError``."""
    names = {field.name for field in msgspec.structs.fields(PrefillSimConfig)}
    given = {k: v for k, v in vars(args).items() if k in names and v is not None}
    try:
        return msgspec.convert(given, PrefillSimConfig)
    except msgspec.ValidationError as exc:
        raise ConfigError("?", given, str(exc)) from exc
