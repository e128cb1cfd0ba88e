"""The sidecar's one frozen config, how it is loaded, and the errors it raises.

Sources, highest precedence first: command-line flags, ``KVR_*`` environment
variables (one per flag: ``--decode-url`` is ``KVR_DECODE_URL``), the variables
other programs read for a few settings (``STANDARD_ENV``: llm-d's sidecar, Go's
``crypto/x509``, reads ``SSL_CERT_FILE`` and ``SSL_CERT_DIR``, OpenTelemetry SDKs
``OTEL_SERVICE_NAME`` and ``OTEL_RESOURCE_ATTRIBUTES``, and deployments set them for
it: KServe's LLMInferenceService sets ``SSL_CERT_DIR``), an optional TOML file
(``--config``), then the defaults below. ``load`` does no I/O beyond reading
that file; a bad value raises ``ConfigError`` naming the field, where the value
came from (flag, variable, or file and key), the value and the reason, and the
CLI exits 2 before any socket opens. A credential's value (``SECRETS``) is never
echoed. The checks live in ``sidecar.config.rules``; every field has its
``--help`` line in ``HELP``.
"""

from __future__ import annotations

import argparse
import difflib
import re
import tomllib
from collections.abc import Mapping, Sequence
from typing import Any, Literal, get_args, get_origin
from urllib.parse import unquote, urlsplit

import msgspec

from sidecar.config.help import HELP
from sidecar.exceptions import SidecarError

ReleaseStrategy = Literal["off", "dry-run", "nixl", "http", "auto"]
PrefillPolicy = Literal["least-outstanding", "round-robin", "first", "random"]
TrustMode = Literal["any", "token", "hmac"]
LogFormat = Literal["json", "text"]
LogLevel = Literal["debug", "info", "warning", "error"]
KvConnectorSetting = Literal["auto", "yes", "no"]
TlsVersion = Literal["1.2", "1.3"]
AnswerStyle = Literal["vllm", "llm-d"]
AllowDefault = Literal["none", "routable"]
UnknownVllm = Literal["newest", "refuse"]  # sidecar.nixl.versions.UnknownPolicy
PrefillLeg = Literal["nixlv2", "skip", "refuse"]
OffReason = Literal["", "kv_connector", "ec_connector", "moriio"]

ENV_PREFIX = "KVR_"
INSPECTED_ROUTES = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/responses",
    "/v1/messages",
    "/inference/v1/generate",
)
# A request line and a few ordinary headers; below this every request would be refused.
MIN_HEADER_BYTES = 1024


# --- errors ------------------------------------------------------------------------------------

# Settings whose values are credentials: never logged, never echoed in an error.
SECRETS = frozenset({"control_token", "trust_token", "trust_key"})
REDACTED = "<redacted>"


def flag_of(field: str) -> str:
    """The ``serve`` flag of setting ``field``."""
    return "--" + field.replace("_", "-")


class ConfigError(SidecarError):
    """A setting that cannot be used; ``str()`` names the field, its source, the value and the reason."""

    def __init__(self, field: str, value: object, reason: str, source: str = "") -> None:
        self.field, self.value, self.reason = field, value, reason
        self.source = source or flag_of(field)
        shown = REDACTED if field in SECRETS and value else value
        super().__init__(f"invalid {field} ({self.source}) = {shown!r}: {reason}")

    def at(self, source: str) -> ConfigError:
        """The same error, naming where the value came from."""
        return ConfigError(self.field, self.value, self.reason, source)


class FileError(ConfigError):
    """The TOML file itself is wrong (unreadable, not TOML, an unknown key); names the file first."""

    def __init__(self, file_name: str, reason: str, key: str = "config", value: object = None) -> None:
        super().__init__(key, file_name if value is None else value, reason, file_name)
        self.args = (f"{file_name}: {reason}",)


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
    read_timeout: float = 0.0
    # Requests in flight to D at most: each stream holds one for its whole length.
    pool_size: int = 4096
    release: ReleaseStrategy = "dry-run"
    # With nixl, http or auto: run every check of that strategy, send nothing (would_send).
    dry_run: bool = False
    release_queue_size: int = 4096
    # Concurrent release jobs (asyncio tasks). Each waits on a hop to the NIXL thread, so a
    # storm needs many in flight: 4 fell behind 1,700 rejections/s, 32 kept up (make bench).
    release_workers: int = 32
    # P's lease in vLLM 0.22.0+; after it P frees the blocks itself.
    release_deadline: float = 30.0
    release_retry_initial: float = 0.05
    release_retry_max: float = 1.0
    release_target_share: float = 0.5
    release_target_failures: int = 3
    ledger_size: int = 65536
    ledger_ttl: float = 600.0
    release_ambiguous: bool = False
    # Statuses a gateway or mesh in front of the decode pods may retry on another pod with the
    # same body (sidecar.retries): never released behind, since that pod's D reads P's blocks. The
    # default: Istio's default retry policy (503) and Envoy's gateway-error (502, 503, 504).
    retried_statuses: tuple[str, ...] = ("502", "503", "504")
    shutdown_delay: float = 0.0
    drain_timeout: float = 20.0
    flush_timeout: float = 5.0
    vllm_version: str = ""
    prefill_allow: tuple[str, ...] = ()
    # What an empty prefill_allow admits without an inference_pool: nothing, or any address a P pod
    # can have (not loopback, link-local, cloud metadata, unspecified, multicast): pd-sidecar's default.
    prefill_allow_default: AllowDefault = "none"
    handshake_timeout: float = 2.0
    handshake_cache_size: int = 256
    handshake_cache_ttl: float = 3600.0
    allow_unsafe_vllm: bool = False
    unknown_vllm: UnknownVllm = "newest"
    log_level: LogLevel = "info"
    log_format: LogFormat = "json"
    # One line per request answered (uvicorn.access); off: a busy pod would log thousands a second.
    access_log: bool = False
    # The control endpoint a vLLM plugin adds to D (strategies http and auto).
    control_url: str = ""
    control_token: str = ""
    control_token_file: str = ""
    control_timeout: float = 1.0
    auto_probe_interval: float = 30.0
    # D's state (sidecar.decode.state): /health is polled this often; while D cannot release P's
    # blocks itself (engine dead, shutting down, no KV connector), the sidecar releases for it.
    decode_health_interval: float = 1.0
    # Whether D runs a KV connector: auto reads D's /metrics; yes or no when it cannot tell.
    decode_kv_connector: KvConnectorSetting = "auto"
    # Router mode: the sidecar runs the prefill leg on one of these P servers.
    prefill: tuple[str, ...] = ()
    prefill_policy: PrefillPolicy = "least-outstanding"
    prefill_timeout: float = 300.0
    # The largest answer P may give the prefill leg: 128k prompt tokens with prompt_logprobs at
    # vLLM's default max_logprobs (20) take about 230 MB of JSON (docs/limits.md).
    prefill_answer_limit: int = 256 * 1024 * 1024
    prefill_backoff: float = 5.0
    decode_only_fallback: bool = False
    # Router mode: decode_url is a kv-release-sidecar in front of D (trust = "hmac" there, this
    # router signing with the same key). It judges and releases D's answers itself, so this
    # router releases only what never reached it or what it aborted (no double release).
    decode_releases: bool = False
    # Which kv_transfer_params may trigger a release (sidecar.proxy.trust): any, a router token, an HMAC.
    trust: TrustMode = "any"
    trust_token: str = ""
    trust_token_file: str = ""
    trust_key: str = ""
    trust_key_file: str = ""
    # Sidecar mode releases the kv_transfer_params a client sends (trust permitting); off, they go
    # to D unchanged and are never released. pd-sidecar turns it off: llm-d's own legs carry P's.
    release_client_params: bool = True
    # Rejection injection for load tests (off by default): the sidecar answers an error itself,
    # never forwards the request, and releases P's blocks as for a real rejection.
    inject_rate: float = 0.0
    inject_seed: int | None = None
    inject_statuses: tuple[int, ...] = (503,)
    inject_routes: tuple[str, ...] = ()
    inject_header: bool = False
    # Server limits on the proxy and admin ports (docs/limits.md); enforced by sidecar.server.protocol.
    limit_concurrency: int = 0
    timeout_keep_alive: float = 5.0  # vLLM's own default: clients see D's connection lifetime
    max_header_bytes: int = 64 * 1024
    client_header_timeout: float = 10.0
    client_body_timeout: float = 60.0
    # OpenTelemetry tracing (sidecar.observability; needs the otel extra): OTLP/HTTP, off when empty.
    otlp_traces_endpoint: str = ""  # e.g. http://otel-collector:4318 (/v1/traces is added to a bare URL)
    trace_sample_ratio: float = 1.0
    trace_service_name: str = "kv-release-sidecar"  # also OTEL_SERVICE_NAME
    # The spans' resource: key=value pairs, as OTEL_RESOURCE_ATTRIBUTES (its values percent-encoded).
    trace_resource_attributes: tuple[str, ...] = ()
    # P's hold of an unreleased request's blocks, for kvr_pinned_block_seconds_saved_total;
    # 0: from P's vLLM release (sidecar.release.hold.DEADLINES).
    p_hold_seconds: float = 0.0
    may_cover_delay: float = 1.0
    # TLS on the proxy port(s) (sidecar.tls): tls.crt and tls.key from tls_cert_dir, reloaded when
    # they change; without a directory, a self-signed certificate made at start.
    tls: bool = False
    tls_cert_dir: str = ""
    tls_min_version: TlsVersion = "1.2"
    tls_ciphers: tuple[str, ...] = ()  # TLS 1.2 suites by IANA name; empty: ECDHE with AES-GCM or ChaCha20
    admin_tls_cert_dir: str = ""  # the admin port serves TLS only when this is set
    # Outbound TLS: an https decode_url is verified; prefill_tls makes header-named P https.
    tls_ca_file: str = ""
    # Trusted beyond the system's store and tls_ca_file, as Go reads SSL_CERT_FILE and SSL_CERT_DIR
    # (sidecar.tls.trust): every certificate of every file in each folder, not only hashed names.
    ssl_cert_file: str = ""
    ssl_cert_dir: tuple[str, ...] = ()  # folders, colon-separated in flags and variables
    decode_tls_insecure: bool = False
    prefill_tls: bool = False
    prefill_tls_insecure: bool = False
    data_parallel_size: int = 1  # ranks: listeners on port..port+N-1, rank r to decode_url's port + r
    workers: str = "1"  # serving processes (sidecar.server.workers); auto: the CPU quota's cores
    pod_ip: str = ""  # this pod's address as x-data-parallel-host-port names a rank (llm-d: POD_IP)
    # P hosts allowed: the pods an InferencePool selects, watched from the Kubernetes API (sidecar.k8s).
    inference_pool: str = ""  # namespace/name
    pool_group: str = "inference.networking.k8s.io"
    pool_side_channel_ports: str = "5600-5663"  # where releases may reach those pods
    kube_service_account: str = "/var/run/secrets/kubernetes.io/serviceaccount"
    # Router mode: a prefill leg answered 502, 503 or 504 (or unreachable) is retried on the same P.
    prefill_max_retries: int = 0
    prefill_retry_backoff: float = 0.2
    # Router mode's leg to a header-named P: nixlv2 (vLLM's NIXL protocol), skip (D alone prefills:
    # llm-d's P/D protocol in use is not run here), refuse (501 to a request naming a P).
    prefill_leg: PrefillLeg = "nixlv2"
    # Why pd-sidecar turned releases off (kvr_releases_enabled's reason): a protocol it cannot release for.
    releases_off_for: OffReason = ""
    # The sidecar's own answers where llm-d's routing sidecar answers differently (docs/llm-d.md).
    answers: AnswerStyle = "vllm"

    def __post_init__(self) -> None:
        from sidecar.config.rules import check  # it imports this module

        check(self)


FIELDS = tuple(f.name for f in msgspec.structs.fields(Config))
# Setting -> the variable other programs read that sets it when its KVR_* variable and flag do not.
STANDARD_ENV = {
    "ssl_cert_file": "SSL_CERT_FILE",
    "ssl_cert_dir": "SSL_CERT_DIR",
    "trace_service_name": "OTEL_SERVICE_NAME",
    "trace_resource_attributes": "OTEL_RESOURCE_ATTRIBUTES",
}
# Lists of paths, split at colons as SSL_CERT_DIR and PATH are (a path may hold a comma).
PATH_LISTS = frozenset({"ssl_cert_dir"})
# KVR_* variables that are not settings of serve but are read by the same install.
OTHER_ENV = {
    "KVR_CONFIG": "the TOML file, as --config",
    "KVR_CONTROL_INSECURE": "the vLLM plugin inside D",
}


def did_you_mean(word: str, candidates: Sequence[str]) -> str:
    """`` (did you mean 'x'?)`` for the closest candidate, or "" when none is close."""
    close = difflib.get_close_matches(word, candidates, n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _default_text(default: Any) -> str:
    if isinstance(default, tuple):
        return ",".join(map(str, default)) or "empty"
    if isinstance(default, bool):
        return "on" if default else "off"
    if isinstance(default, float):
        return f"{default:g}"
    return "empty" if default in ("", None) else str(default)


def help_line(name: str, default: Any) -> str:
    """The plain-text ``--help`` line of field ``name``."""
    text, unit = HELP[name]
    details = [unit] if unit else []
    details += [f"default {_default_text(default)}", f"env {ENV_PREFIX}{name.upper()}"]
    if name in STANDARD_ENV:
        details[-1] += f" or {STANDARD_ENV[name]}"
    return f"{text} ({'; '.join(details)})"


def _field_info() -> list[tuple[str, Any, Any]]:
    return [(f.name, f.type, f.default) for f in msgspec.structs.fields(Config)]


def _metavar(unit: str) -> str:
    if "list" in unit:
        return "LIST"
    words = {"seconds": "SECONDS", "bytes": "BYTES", "URL": "URL", "path": "FILE", "": "TEXT"}
    return words.get(unit, "PORT" if unit.startswith("TCP port") else "N")


def build_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add one flag per config field (defaults left unset so precedence can be applied)."""
    parser.add_argument(
        "--config", metavar="FILE", help="TOML file with settings, keys are the field names (env KVR_CONFIG)"
    )
    for name, type_, default in _field_info():
        kwargs: dict[str, Any] = {"default": None, "dest": name}
        if type_ is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif get_args(type_) and isinstance(get_args(type_)[0], str) and type_ is not str:
            kwargs["choices"] = list(get_args(type_))
        else:
            kwargs["metavar"] = _metavar(HELP[name][1])
        kwargs["help"] = help_line(name, default).replace("%", "%%")
        parser.add_argument(flag_of(name), **kwargs)
    return parser


def load(
    args: argparse.Namespace | Mapping[str, Any],
    environ: Mapping[str, str],
    file_text: str | None = None,
    file_name: str = "the config file",
) -> Config:
    """Merge defaults < TOML file < environment < flags into a validated ``Config``.

    An error names where the offending value came from: the flag, the ``KVR_*``
    variable, or ``file_name`` and the key.
    """
    return load_with_sources(args, environ, file_text, file_name)[0]


def load_with_sources(
    args: argparse.Namespace | Mapping[str, Any],
    environ: Mapping[str, str],
    file_text: str | None = None,
    file_name: str = "the config file",
) -> tuple[Config, dict[str, str]]:
    """``load``, and where each value that is not a default came from (for later checks' errors)."""
    flags = vars(args) if isinstance(args, argparse.Namespace) else dict(args)
    names = {name: type_ for name, type_, _ in _field_info()}
    merged: dict[str, Any] = {}
    source: dict[str, str] = {}
    for key, value in _read_toml(file_text, file_name).items():
        if key not in names:
            raise FileError(file_name, f"unknown key {key!r}{did_you_mean(key, FIELDS)}", key, value)
        merged[key], source[key] = value, f"{file_name}, key {key}"
    for name, (value, variable) in standard_env(environ).items():
        merged[name], source[name] = value, variable
    for name in names:
        variable = ENV_PREFIX + name.upper()
        if environ.get(variable) is not None:
            merged[name], source[name] = environ[variable], variable
        if flags.get(name) is not None:
            merged[name], source[name] = flags[name], flag_of(name)
    for key in flags.keys() - names.keys():
        if flags[key] is not None:
            raise ConfigError(key, flags[key], f"unknown setting{did_you_mean(key, FIELDS)}")
    for name, value in list(merged.items()):
        if isinstance(value, str) and HELP[name][1] == "seconds":
            merged[name] = _seconds(name, value, source.get(name, ""))
        if isinstance(value, str) and get_origin(names[name]) is tuple:
            parts = value.split(":" if name in PATH_LISTS else ",")
            merged[name] = value = [part.strip() for part in parts if part.strip()]
        if isinstance(value, list) and get_args(names[name])[:1] == (str,):
            merged[name] = [str(item) if isinstance(item, int) else item for item in value]  # [503]
    try:
        return _convert(merged, names), source
    except ConfigError as exc:
        raise exc.at(source.get(exc.field, exc.source)) from exc.__cause__


def standard_env(environ: Mapping[str, str]) -> dict[str, tuple[str, str]]:
    """The settings ``STANDARD_ENV``'s variables give (field -> value, variable); an empty one is
    unset. OTEL_SERVICE_NAME wins over a ``service.name`` in OTEL_RESOURCE_ATTRIBUTES, as the
    OpenTelemetry specification has it."""
    found = {
        name: (environ[variable], variable)
        for name, variable in STANDARD_ENV.items()
        if environ.get(variable, "").strip()
    }
    if "trace_service_name" not in found and "trace_resource_attributes" in found:
        for item in found["trace_resource_attributes"][0].split(","):
            key, _, value = item.partition("=")
            if key.strip() == "service.name" and value.strip():
                found["trace_service_name"] = (unquote(value.strip()), "OTEL_RESOURCE_ATTRIBUTES")
    return found


def _read_toml(text: str | None, file_name: str) -> dict[str, Any]:
    if text is None:
        return {}
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise FileError(file_name, f"not valid TOML: {exc}") from exc


_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
SECONDS_HINT = "must be a number of seconds, or a duration such as 30s, 500ms or 2m"


def _seconds(name: str, text: str, source: str) -> float:
    """``"30"``, ``"30s"``, ``"500ms"``, ``"2m"``, ``"1h"`` as seconds; raises ``ConfigError``."""
    match = re.fullmatch(r"\s*(-?[0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*(ms|s|m|h)?\s*", text, re.IGNORECASE)
    if match is None:
        raise ConfigError(name, text, SECONDS_HINT, source)
    return float(match.group(1)) * _UNITS[(match.group(2) or "s").lower()]


def _convert(merged: dict[str, Any], names: Mapping[str, Any]) -> Config:
    try:
        return msgspec.convert(merged, Config, strict=False)
    except ConfigError:
        raise
    except msgspec.ValidationError as exc:
        message = str(exc)
        field = message.rsplit("$.", 1)[-1].split("[")[0].strip("`") if "$." in message else "?"
        reason = SECONDS_HINT if field in HELP and HELP[field][1] == "seconds" else None
        raise ConfigError(field, merged.get(field), reason or _reason(message, names.get(field))) from exc


def _reason(message: str, type_: Any) -> str:
    """msgspec's message as plain text: the choices of a Literal, the expected type otherwise."""
    choices = [c for c in get_args(type_) if isinstance(c, str)]
    if choices and get_origin(type_) is Literal:
        return "must be one of " + ", ".join(choices)
    if type_ is bool:
        return "must be true or false (or 1 or 0)"
    text = message.split(" - at ")[0].replace("`", "")
    return text.split(", got ")[0].replace("Expected", "expected")


def unknown_env(environ: Mapping[str, str]) -> list[str]:
    """A warning for each ``KVR_*`` variable serve does not read (a misspelt one is ignored)."""
    known = set(env_names()) | OTHER_ENV.keys()
    return [
        f"{name} is not a setting and is ignored{did_you_mean(name, sorted(known))}"
        for name in sorted(environ)
        if name.startswith(ENV_PREFIX) and name not in known
    ]


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


def env_names() -> Sequence[str]:
    """Every ``KVR_*`` variable the sidecar reads (the deploy checks compare against it)."""
    return [ENV_PREFIX + name.upper() for name, _, _ in _field_info()]
