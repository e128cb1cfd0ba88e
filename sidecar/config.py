"""The sidecar's one frozen config, and how it is loaded.

Sources, highest precedence first: command-line flags, ``KVR_*`` environment
variables (one per flag: ``--decode-url`` is ``KVR_DECODE_URL``), an optional
TOML file (``--config``), then the defaults below. ``load`` does no I/O
beyond reading that file; a bad value raises ``ConfigError`` naming the
field, the value and the reason, and the CLI exits 2 before any socket opens.
"""

from __future__ import annotations

import argparse
import ipaddress
import tomllib
from collections.abc import Mapping, Sequence
from typing import Any, Literal, get_args, get_origin
from urllib.parse import urlsplit

import msgspec

ReleaseStrategy = Literal["off", "dry-run", "nixl", "http", "auto"]
PrefillPolicy = Literal["least-outstanding", "round-robin"]
TrustMode = Literal["any", "token", "hmac"]
LogFormat = Literal["json", "text"]
LogLevel = Literal["debug", "info", "warning", "error"]

ENV_PREFIX = "KVR_"
INSPECTED_ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/responses")


class Config(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Every setting of ``kv-release-sidecar serve``. Field ``a_b`` is flag ``--a-b``."""

    host: str = "0.0.0.0"
    port: int = 8000
    admin_host: str = "0.0.0.0"
    admin_port: int = 9100
    decode_url: str = "http://127.0.0.1:8200"
    max_body_bytes: int = 64 * 1024 * 1024
    connect_timeout: float = 5.0
    pool_timeout: float = 5.0
    # Non-streaming completions send headers only when generation ends: keep it long.
    header_timeout: float = 900.0
    # Maximum gap between two body chunks from D; 0 disables (streams may idle).
    read_timeout: float = 0.0
    pool_size: int = 1024
    release: ReleaseStrategy = "dry-run"
    release_queue_size: int = 4096
    # Concurrent release jobs (asyncio tasks). Each waits on a hop to the NIXL thread, so a
    # storm needs many in flight: 4 fell behind 1,700 rejections/s, 32 kept up (make bench).
    release_workers: int = 32
    # P's lease in vLLM 0.22.0+; after it P frees the blocks itself.
    release_deadline: float = 30.0
    release_retry_initial: float = 0.05
    release_retry_max: float = 1.0
    # Share of release_workers one target (a P side channel, D's control endpoint) may use at once.
    release_target_share: float = 0.5
    # Consecutive connect failures after which a target's breaker opens (its jobs wait, no attempt).
    release_target_failures: int = 3
    ledger_size: int = 65536
    ledger_ttl: float = 600.0
    # Ambiguous outcomes (D may have admitted the request) are not released by default.
    release_ambiguous: bool = False
    # On SIGTERM: readiness off, keep serving this long, then drain and flush.
    shutdown_delay: float = 0.0
    drain_timeout: float = 20.0
    flush_timeout: float = 5.0
    vllm_version: str = ""
    prefill_allow: tuple[str, ...] = ()
    handshake_timeout: float = 2.0
    handshake_cache_size: int = 256
    handshake_cache_ttl: float = 3600.0
    allow_unsafe_vllm: bool = False
    log_level: LogLevel = "info"
    log_format: LogFormat = "json"
    # The control endpoint a vLLM plugin adds to D (strategies http and auto).
    control_url: str = ""  # default: decode_url + /kv_release/v1/release
    control_token: str = ""  # prefer KVR_CONTROL_TOKEN or control_token_file: flags show in ps
    control_token_file: str = ""
    control_timeout: float = 1.0
    auto_probe_interval: float = 30.0
    # Router mode: the sidecar runs the prefill leg on one of these P servers.
    prefill: tuple[str, ...] = ()
    prefill_policy: PrefillPolicy = "least-outstanding"
    prefill_timeout: float = 300.0
    prefill_backoff: float = 5.0  # a failing P is skipped this long
    decode_only_fallback: bool = False  # no P left (or n > 1): D prefills itself
    # Router mode: decode_url is a kv-release-sidecar in front of D (trust = "hmac" there, this
    # router signing with the same key). It judges and releases D's answers itself, so this
    # router releases only what never reached it or what it aborted (no double release).
    decode_releases: bool = False
    # Which kv_transfer_params may trigger a release (sidecar.trust): any, a router token, an HMAC.
    trust: TrustMode = "any"
    trust_token: str = ""
    trust_token_file: str = ""
    trust_key: str = ""  # HMAC key shared with the router; prefer trust_key_file
    trust_key_file: str = ""
    # Rejection injection for load tests (off by default): the sidecar answers an error itself,
    # never forwards the request, and releases P's blocks as for a real rejection.
    inject_rate: float = 0.0  # share of releasable do_remote_prefill requests, 0..1
    inject_seed: int | None = None  # reproducible injection
    inject_statuses: tuple[int, ...] = (503,)
    inject_routes: tuple[str, ...] = ()  # empty: all three completion routes
    inject_header: bool = False  # honour x-kvr-inject-reject: <status>
    # Server limits on the proxy and admin ports (docs/limits.md); enforced by sidecar.limits.
    limit_concurrency: int = 0  # requests in flight on the proxy port; over it: 503; 0 = unlimited
    timeout_keep_alive: float = 5.0  # idle keep-alive connection closed after this (vLLM's default)
    max_header_bytes: int = 64 * 1024  # request line + headers; over it: 431 and close
    client_header_timeout: float = 10.0  # a complete header block within this; else 408 and close
    client_body_timeout: float = 60.0  # largest gap between two reads of a request body; else 408
    # OpenTelemetry tracing (sidecar.tracing; needs kv-release-sidecar[otel]): OTLP/HTTP, off when empty.
    otlp_traces_endpoint: str = ""  # e.g. http://otel-collector:4318 (/v1/traces is added to a bare URL)
    trace_sample_ratio: float = 1.0  # share of new traces sampled; a sampled traceparent is always honoured
    trace_service_name: str = "kv-release-sidecar"
    # P's hold of an unreleased request's blocks, for kvr_pinned_block_seconds_saved_total;
    # 0: from P's vLLM release (30 s lease from 0.22.0, 480 s abort timeout before).
    p_hold_seconds: float = 0.0

    def __post_init__(self) -> None:
        for name in ("port", "admin_port"):
            value = getattr(self, name)
            if not 0 <= value <= 65535:
                raise ConfigError(name, value, "must be a TCP port between 0 and 65535")
        if self.port and self.port == self.admin_port:
            raise ConfigError("admin_port", self.admin_port, "must differ from port")
        url = urlsplit(self.decode_url)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ConfigError("decode_url", self.decode_url, "must be an http(s) URL with a host")
        for name in _POSITIVE:
            value = getattr(self, name)
            if value <= 0:
                raise ConfigError(name, value, "must be greater than 0")
        if self.limit_concurrency < 0:
            raise ConfigError(
                "limit_concurrency", self.limit_concurrency, "must be 0 (unlimited) or positive"
            )
        if self.max_header_bytes < MIN_HEADER_BYTES:
            raise ConfigError(
                "max_header_bytes", self.max_header_bytes, f"must be at least {MIN_HEADER_BYTES} bytes"
            )
        for name in ("read_timeout", "shutdown_delay", "p_hold_seconds"):
            if getattr(self, name) < 0:
                raise ConfigError(name, getattr(self, name), "must be 0 (off) or positive")
        if self.release_retry_initial > self.release_retry_max:
            raise ConfigError(
                "release_retry_initial", self.release_retry_initial, "must not exceed release_retry_max"
            )
        for name, value in [("control_url", self.control_url), *(("prefill", p) for p in self.prefill)]:
            parts = urlsplit(value)
            if value and (parts.scheme not in ("http", "https") or not parts.hostname):
                raise ConfigError(name, value, "must be an http(s) URL with a host")
        if self.vllm_version and not _is_version(self.vllm_version):
            raise ConfigError("vllm_version", self.vllm_version, "must look like 0.21.0")
        if not 0.0 < self.release_target_share <= 1.0:
            raise ConfigError(
                "release_target_share", self.release_target_share, "must be above 0 and at most 1"
            )
        if not 0.0 <= self.inject_rate <= 1.0:
            raise ConfigError("inject_rate", self.inject_rate, "must be between 0 and 1")
        for status in self.inject_statuses:
            if not 400 <= status <= 599:
                raise ConfigError("inject_statuses", status, "must be a 4xx or 5xx status")
        if self.inject_rate and not self.inject_statuses:
            raise ConfigError("inject_statuses", self.inject_statuses, "must name a status to inject")
        for route in self.inject_routes:
            if route not in INSPECTED_ROUTES:
                raise ConfigError("inject_routes", route, f"must be one of {', '.join(INSPECTED_ROUTES)}")
        for pattern in self.prefill_allow:
            reason = allow_pattern_error(pattern)
            if reason:
                raise ConfigError("prefill_allow", pattern, reason)
        traces = urlsplit(self.otlp_traces_endpoint)
        if self.otlp_traces_endpoint and (traces.scheme not in ("http", "https") or not traces.hostname):
            raise ConfigError(
                "otlp_traces_endpoint", self.otlp_traces_endpoint, "must be an http(s) URL (OTLP/HTTP)"
            )
        if not 0.0 <= self.trace_sample_ratio <= 1.0:
            raise ConfigError("trace_sample_ratio", self.trace_sample_ratio, "must be between 0 and 1")
        if not self.trace_service_name.strip():
            raise ConfigError("trace_service_name", self.trace_service_name, "must not be empty")


_POSITIVE = (
    "max_body_bytes",
    "connect_timeout",
    "pool_timeout",
    "header_timeout",
    "pool_size",
    "release_queue_size",
    "release_workers",
    "release_deadline",
    "release_retry_initial",
    "release_retry_max",
    "release_target_failures",
    "ledger_size",
    "ledger_ttl",
    "drain_timeout",
    "flush_timeout",
    "handshake_timeout",
    "handshake_cache_size",
    "handshake_cache_ttl",
    "control_timeout",
    "auto_probe_interval",
    "prefill_timeout",
    "prefill_backoff",
    "timeout_keep_alive",
    "client_header_timeout",
    "client_body_timeout",
)
# A request line and a few ordinary headers; below this every request would be refused.
MIN_HEADER_BYTES = 1024


class ConfigError(Exception):
    """A setting that cannot be used; ``str()`` names the field, the value and the reason."""

    def __init__(self, field: str, value: object, reason: str) -> None:
        self.field, self.value, self.reason = field, value, reason
        shown = REDACTED if field in SECRETS and value else value
        super().__init__(f"invalid {field} ({_flag(field)}) = {shown!r}: {reason}")


# Settings whose values are credentials: never logged, never echoed in an error.
SECRETS = frozenset({"control_token", "trust_token", "trust_key"})
REDACTED = "<redacted>"


def _flag(field: str) -> str:
    return "--" + field.replace("_", "-")


def _is_version(text: str) -> bool:
    parts = text.split(".")
    return len(parts) >= 2 and all(p.isdigit() for p in parts[:2])


def allow_pattern_error(pattern: str) -> str:
    """Why an allowlist entry is invalid, or "" when it is valid.

    Entries: a CIDR (``10.0.0.0/8``), an IP, a host name (``*.prefill.svc`` allowed),
    each optionally with ``:port`` or ``:lo-hi`` (IPv6 with a port: ``[::1]:5600``).
    """
    from sidecar.allowlist import parse_entry  # local: allowlist imports nothing of ours

    try:
        parse_entry(pattern)
    except ValueError as exc:
        return str(exc)
    return ""


def _field_info() -> list[tuple[str, Any, Any]]:
    info = msgspec.structs.fields(Config)
    return [(f.name, f.type, f.default) for f in info]


def build_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add one flag per config field (defaults left unset so precedence can be applied)."""
    parser.add_argument("--config", help="TOML file with settings (keys are field names)")
    for name, type_, default in _field_info():
        kwargs: dict[str, Any] = {"default": None, "dest": name}
        if type_ is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif get_args(type_) and isinstance(get_args(type_)[0], str) and type_ is not str:
            kwargs["choices"] = list(get_args(type_))
        shown = ",".join(map(str, default)) if isinstance(default, tuple) else default
        kwargs["help"] = f"(env {ENV_PREFIX}{name.upper()}; default {shown!r})"
        parser.add_argument(_flag(name), **kwargs)
    return parser


def load(
    args: argparse.Namespace | Mapping[str, Any],
    environ: Mapping[str, str],
    file_text: str | None = None,
) -> Config:
    """Merge defaults < TOML file < environment < flags into a validated ``Config``."""
    flags = vars(args) if isinstance(args, argparse.Namespace) else dict(args)
    merged: dict[str, Any] = {}
    if file_text is not None:
        try:
            merged.update(tomllib.loads(file_text))
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError("config", "<file>", f"not valid TOML: {exc}") from exc
    names = {name: type_ for name, type_, _ in _field_info()}
    for name in names:
        env_value = environ.get(ENV_PREFIX + name.upper())
        if env_value is not None:
            merged[name] = env_value
        if flags.get(name) is not None:
            merged[name] = flags[name]
    for key in merged:
        if key not in names:
            raise ConfigError(key, merged[key], "unknown setting")
    for name, value in list(merged.items()):
        if isinstance(value, str) and get_origin(names[name]) is tuple:
            merged[name] = [part.strip() for part in value.split(",") if part.strip()]
    return _convert(merged)


def _convert(merged: dict[str, Any]) -> Config:
    try:
        return msgspec.convert(merged, Config, strict=False)
    except ConfigError:
        raise
    except msgspec.ValidationError as exc:
        message = str(exc)
        field = message.rsplit("$.", 1)[-1].split("[")[0].strip("`") if "$." in message else "?"
        raise ConfigError(field, merged.get(field), message.split(" - at ")[0]) from exc


def dump(config: Config) -> dict[str, Any]:
    """The effective config as plain data for the start-up log line, credentials redacted
    (the secret settings, and a user:password in the OTLP endpoint URL)."""
    data = dict(msgspec.to_builtins(config))
    for name in SECRETS:
        if data.get(name):
            data[name] = REDACTED
    endpoint = urlsplit(config.otlp_traces_endpoint)
    if endpoint.username is not None or endpoint.password is not None:
        host = endpoint.netloc.rpartition("@")[2]
        data["otlp_traces_endpoint"] = endpoint._replace(netloc=f"{REDACTED}@{host}").geturl()
    return data


def parse_host_port(text: str) -> tuple[str, int]:
    """Split ``host:port`` / ``[v6]:port``; raises ValueError."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"{text!r} is not host:port")
    host = host.strip("[]")
    if host and ":" not in host:
        pass
    elif host:
        ipaddress.ip_address(host)
    return host, int(port)


def env_names() -> Sequence[str]:
    """Every ``KVR_*`` variable the sidecar reads (the deploy checks compare against it)."""
    return [ENV_PREFIX + name.upper() for name, _, _ in _field_info()]
