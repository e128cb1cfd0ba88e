"""The checks a ``Config`` must pass, run by ``Config.__post_init__``.

Each failed check raises ``ConfigError`` naming the field, the value and the
reason; ``sidecar.config.load`` then adds where the value came from (the
flag, the ``KVR_*`` variable or the file and key). Pure: no I/O, no sockets.
"""

from __future__ import annotations

import ipaddress
from typing import TYPE_CHECKING
from urllib.parse import SplitResult, urlsplit

from sidecar.config import INSPECTED_ROUTES, MIN_HEADER_BYTES, ConfigError

if TYPE_CHECKING:
    from sidecar.config import Config

# The InferencePool API groups the watch reads, and the version of each (llm-d's allowlist.go).
POOL_VERSIONS = {"inference.networking.k8s.io": "v1", "inference.networking.x-k8s.io": "v1alpha2"}
POSITIVE = (
    "max_body_bytes",
    "prefill_answer_limit",
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
    "prefill_retry_backoff",
    "data_parallel_size",
)
ZERO_OR_POSITIVE = (
    "read_timeout",
    "decode_health_interval",
    "shutdown_delay",
    "p_hold_seconds",
    "limit_concurrency",
    "may_cover_delay",
    "prefill_max_retries",
)
SHARES = ("inject_rate", "trace_sample_ratio")
ADMIN_PORT_DEFAULT = 9100


def check(config: Config) -> None:
    """Raise ``ConfigError`` for the first setting ``config`` cannot be used with."""
    _ports(config)
    _urls(config)
    _numbers(config)
    _injection(config)
    _retries(config)
    for pattern in config.prefill_allow:
        reason = allow_pattern_error(pattern)
        if reason:
            raise ConfigError("prefill_allow", pattern, reason)
    if config.vllm_version and not _is_version(config.vllm_version):
        raise ConfigError("vllm_version", config.vllm_version, "must look like 0.21.0")
    if config.dry_run and config.release not in ("nixl", "http", "auto"):
        raise ConfigError(
            "dry_run",
            config.dry_run,
            f"needs --release nixl, http or auto (--release {config.release} sends nothing already)",
        )
    if not config.trace_service_name.strip():
        raise ConfigError("trace_service_name", config.trace_service_name, "must not be empty")
    # Checked only with tracing on: OTEL_RESOURCE_ATTRIBUTES set for other programs stops nothing.
    for item in config.trace_resource_attributes if config.otlp_traces_endpoint else ():
        if not item.partition("=")[0].strip() or "=" not in item:
            raise ConfigError("trace_resource_attributes", item, "must be key=value")
    _serving(config)


def _ports(config: Config) -> None:
    for name in ("port", "admin_port"):
        value = getattr(config, name)
        if not 0 <= value <= 65535:
            raise ConfigError(name, value, "must be a TCP port between 0 and 65535")
    if config.port and config.port == config.admin_port:
        # Blame the one moved from its default: "--port 9100" alone collides with the admin port.
        if config.admin_port == ADMIN_PORT_DEFAULT:
            raise ConfigError("port", config.port, f"is admin_port's too ({config.admin_port})")
        raise ConfigError("admin_port", config.admin_port, f"is port's too ({config.port})")


def _urls(config: Config) -> None:
    # D and P are addressed by scheme, host and port only: the sidecar forwards each request's own
    # path (/v1/chat/completions), so a base path such as /v1 would make every request a 404.
    bases = [("decode_url", config.decode_url), *(("prefill", url) for url in config.prefill)]
    for name, value in bases:
        reason = url_error(value) or _path_error(urlsplit(value))
        if reason:
            raise ConfigError(name, value, reason)
    for name, value in (
        ("control_url", config.control_url),
        ("otlp_traces_endpoint", config.otlp_traces_endpoint),
    ):
        reason = url_error(value) if value else ""
        if reason:
            raise ConfigError(name, value, reason)


def url_error(value: str) -> str:
    """Why ``value`` is not a usable http(s) URL, or "" when it is."""
    parts = urlsplit(value)
    hostport = parts.netloc.rpartition("@")[2]
    if parts.scheme in ("http", "https") and hostport.count(":") > 1 and "[" not in hostport:
        return f"an IPv6 address needs brackets: {parts.scheme}://{_bracketed(hostport)}"
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return "must be an http(s) URL with a host"
    try:
        port = parts.port
    except ValueError:
        return f"port {parts.netloc.rpartition(':')[2]!r} is not a TCP port (1-65535)"
    if port == 0:
        return "port 0 is not a TCP port (1-65535)"
    return ""


def _bracketed(netloc: str) -> str:
    """``::1:8200`` -> ``[::1]:8200``; ``fe80::1`` (no port) -> ``[fe80::1]``."""
    host, _, port = netloc.rpartition(":")
    for address, suffix in ((host, f":{port}"), (netloc, "")):  # a trailing number is a port
        try:
            ipaddress.IPv6Address(address)
        except ValueError:
            continue
        return f"[{address}]{suffix}"
    return f"[{netloc}]"


def _path_error(parts: SplitResult) -> str:
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        rest = parts.geturl().partition(parts.netloc)[2]
        return (
            f"must be scheme://host:port without a path (got {rest!r}): "
            "each request's own path (/v1/...) is forwarded as it is"
        )
    return ""


MAX_WORKERS = 32  # as sidecar.release.table.MAX_WORKERS (its shards, at most)


def _numbers(config: Config) -> None:
    workers = config.workers
    if workers != "auto" and not (workers.isdigit() and 1 <= int(workers) <= MAX_WORKERS):
        raise ConfigError("workers", config.workers, f"must be auto or a number of processes 1-{MAX_WORKERS}")
    for name in POSITIVE:
        value = getattr(config, name)
        if value <= 0:
            raise ConfigError(name, value, "must be greater than 0")
    for name in ZERO_OR_POSITIVE:
        if getattr(config, name) < 0:
            raise ConfigError(name, getattr(config, name), "must be 0 (off) or positive")
    for name in SHARES:
        if not 0.0 <= getattr(config, name) <= 1.0:
            raise ConfigError(name, getattr(config, name), "must be between 0 and 1")
    if config.max_header_bytes < MIN_HEADER_BYTES:
        raise ConfigError(
            "max_header_bytes", config.max_header_bytes, f"must be at least {MIN_HEADER_BYTES} bytes"
        )
    if not 0.0 < config.release_target_share <= 1.0:
        raise ConfigError(
            "release_target_share", config.release_target_share, "must be above 0 and at most 1"
        )
    if config.release_retry_initial > config.release_retry_max:
        raise ConfigError(
            "release_retry_initial", config.release_retry_initial, "must not exceed release_retry_max"
        )


def _retries(config: Config) -> None:
    from sidecar import retries  # local: like allowlist, a leaf module

    problem = retries.problem(config.retried_statuses)
    if problem:
        raise ConfigError("retried_statuses", ",".join(config.retried_statuses), problem)


def _injection(config: Config) -> None:
    for status in config.inject_statuses:
        if not 400 <= status <= 599:
            raise ConfigError("inject_statuses", status, "must be a 4xx or 5xx status")
    if config.inject_rate and not config.inject_statuses:
        raise ConfigError("inject_statuses", config.inject_statuses, "must name a status to inject")
    for route in config.inject_routes:
        if route not in INSPECTED_ROUTES:
            raise ConfigError("inject_routes", route, f"must be one of {', '.join(INSPECTED_ROUTES)}")


def _serving(config: Config) -> None:
    """TLS, data-parallel ranks and the InferencePool (names checked here, files at start)."""
    from sidecar.tls.names import cipher_error  # local: only TLS settings need it

    for name in config.tls_ciphers:
        reason = cipher_error(name)
        if reason:
            raise ConfigError("tls_ciphers", name, reason)
    last = config.port + config.data_parallel_size - 1
    if config.data_parallel_size > 1 and (config.port == 0 or last > 65535):
        reason = f"needs port 1-{65536 - config.data_parallel_size} for ranks port..port+{last - config.port}"
        raise ConfigError("data_parallel_size", config.data_parallel_size, reason)
    if config.inference_pool and not _pool_name(config.inference_pool):
        raise ConfigError("inference_pool", config.inference_pool, "must be namespace/name")
    if config.pool_group not in POOL_VERSIONS:
        reason = "must be inference.networking.k8s.io (v1) or inference.networking.x-k8s.io (v1alpha2)"
        raise ConfigError("pool_group", config.pool_group, reason)
    if config.releases_off_for and config.release != "off":
        reason = f"releases are off for this P/D protocol: release must be off, not {config.release}"
        raise ConfigError("releases_off_for", config.releases_off_for, reason)
    reason = allow_pattern_error(f"0.0.0.0/0:{config.pool_side_channel_ports}")
    if reason or "-" not in config.pool_side_channel_ports:
        raise ConfigError(
            "pool_side_channel_ports", config.pool_side_channel_ports, reason or "must be lo-hi"
        )


def _pool_name(text: str) -> bool:
    parts = text.split("/")
    return len(parts) == 2 and all(p and p.replace("-", "a").replace(".", "a").isalnum() for p in parts)


def _is_version(text: str) -> bool:
    parts = text.split(".")
    return len(parts) >= 2 and all(p.isdigit() for p in parts[:2])


def allow_pattern_error(pattern: str) -> str:
    """Why an allowlist entry is invalid, or "" when it is valid.

    Entries: a CIDR (``10.0.0.0/8``), an IP, a host name (``*.prefill.svc`` allowed),
    each optionally with ``:port`` or ``:lo-hi`` (IPv6 with a port: ``[::1]:5600``).
    """
    from sidecar.network.allowlist import parse_entry  # local: allowlist imports nothing of ours

    try:
        parse_entry(pattern)
    except ValueError as exc:
        return str(exc)
    return ""
