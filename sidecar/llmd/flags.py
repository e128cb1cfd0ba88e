"""llm-d's routing-sidecar command line, read into this project's settings.

Every flag of llm-d's ``pd-sidecar`` is accepted in pflag's forms (``--name=value``,
``--name value``, a switch alone or ``--name=false``), with the environment
variables llm-d reads (``INFERENCE_POOL``, ``ENABLE_PREFILLER_SAMPLING``, ``POD_IP``)
and its ``--configuration``/``--configuration-file`` YAML
(strict; flags win). ``settings`` maps them onto ``Config`` fields; a flag this
sidecar cannot honour (another KV connector, an encoder stage, chunked decode,
MoRI-IO, speculative prefill, P2P pulls) raises ``ConfigError`` naming it and why.
The mapping table in docs/llm-d.md is checked against ``MAPPING``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from sidecar.config import ConfigError

# flag -> (kind, the Config fields it sets: what the docs table shows)
MAPPING: dict[str, tuple[str, str]] = {
    "port": ("int", "port (rank 0; ranks above on port + rank)"),
    "model-server-port": ("int", "decode_url = http(s)://localhost:PORT"),
    "vllm-port": ("int", "decode_url, as --model-server-port (deprecated)"),
    "data-parallel-size": ("int", "data_parallel_size"),
    "kv-connector": ("str", "nixlv2 only: release = nixl"),
    "ec-connector": ("str", "refused unless empty"),
    "secure-serving": ("bool", "tls"),
    "secure-proxy": ("bool", "tls (deprecated)"),
    "cert-path": ("str", "tls_cert_dir"),
    "enable-tls": ("list", "prefiller: prefill_tls; decoder: decode_url https"),
    "tls-insecure-skip-verify": ("list", "prefill_tls_insecure, decode_tls_insecure"),
    "tls-min-version": ("str", "tls_min_version"),
    "tls-cipher-suites": ("list", "tls_ciphers"),
    "enable-ssrf-protection": ("bool", "inference_pool required"),
    "inference-pool": ("str", "inference_pool (name alone: default/name)"),
    "pool-group": ("str", "pool_group"),
    "max-idle-conns-per-host": ("int", "pool_size"),
    "prefill-max-retries": ("int", "prefill_max_retries"),
    "prefill-retry-backoff": ("duration", "prefill_retry_backoff"),
    "decode-chunk-size": ("int", "refused unless 0"),
    "enable-prefiller-sampling": ("bool", "prefill_policy = random (else first)"),
    "enable-speculative-prefill": ("bool", "refused when on"),
    "enable-p2p-pull": ("bool", "refused when on"),
    "mooncake-bootstrap-port": ("int", "no effect with nixlv2, as in llm-d"),
    "p2p-connector-port": ("int", "no effect with nixlv2, as in llm-d"),
    "tracing": ("bool", "otlp_traces_endpoint from OTEL_EXPORTER_OTLP_(TRACES_)ENDPOINT"),
    "metrics-port": ("int", "admin_port (when not 0)"),
    "metrics-cert-dir": ("str", "admin_tls_cert_dir"),
    "configuration": ("str", "the same settings as YAML, inline"),
    "configuration-file": ("str", "the same settings as a YAML file"),
    "zap-log-level": ("str", "log_level"),
    "zap-encoder": ("str", "log_format (console: text)"),
    "zap-devel": ("bool", "log_level debug, log_format text"),
    "zap-stacktrace-level": ("str", "accepted; tracebacks are logged with errors"),
    "zap-time-encoding": ("str", "accepted; timestamps are ISO 8601"),
}
MORIIO_PREFIX = "moriio-"
STAGES = ("prefiller", "decoder", "encoder")
TLS_VERSIONS = {"VersionTLS12": "1.2", "VersionTLS13": "1.3"}
ZAP_LEVELS = {"debug": "debug", "info": "info", "warn": "warning", "error": "error", "dpanic": "error"}
ZAP_LEVELS |= {"panic": "error", "fatal": "error"}
_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ns|us|µs|ms|s|m|h)")
_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def refuse(flag: str, value: object, reason: str) -> ConfigError:
    return ConfigError(flag, value, reason, f"--{flag}")


def duration(flag: str, text: str) -> float:
    """A Go duration (``200ms``, ``1m30s``) in seconds."""
    parts = _DURATION.findall(text)
    if not parts or "".join(n + u for n, u in parts) != text:
        raise refuse(flag, text, "must be a duration such as 200ms, 1s or 1m30s")
    return sum(float(n) * _UNITS[u] for n, u in parts)


def as_bool(flag: str, value: object) -> bool:
    text = str(value).strip().lower()
    if text in ("1", "t", "true"):
        return True
    if text in ("0", "f", "false"):
        return False
    raise refuse(flag, value, "must be true or false")


def as_int(flag: str, value: object) -> int:
    try:
        return int(str(value))
    except ValueError:
        raise refuse(flag, value, "must be a whole number") from None


def as_list(value: object) -> list[str]:
    items = value if isinstance(value, list) else str(value).split(",")
    return [str(i).strip() for i in items if str(i).strip()]


def settings(given: Mapping[str, Any], environ: Mapping[str, str]) -> dict[str, Any]:
    """The ``Config`` values llm-d's flags ask for (``given``: flag name -> raw value)."""
    given = {**_from_env(environ), **given}
    _refusals(given)
    out: dict[str, Any] = {"pod_ip": environ["POD_IP"].strip()} if environ.get("POD_IP") else {}
    _serving(given, out)
    _routing(given, out)
    _observability(given, out, environ)
    return out


def _from_env(environ: Mapping[str, str]) -> dict[str, Any]:
    found: dict[str, Any] = {}
    if environ.get("INFERENCE_POOL"):
        found["inference-pool"] = environ["INFERENCE_POOL"]
    sampling = environ.get("ENABLE_PREFILLER_SAMPLING", "").strip().lower()
    if sampling in ("1", "t", "true", "0", "f", "false"):
        found["enable-prefiller-sampling"] = sampling
    return found


def _refusals(given: Mapping[str, Any]) -> None:
    connector = str(given.get("kv-connector", "nixlv2"))
    if connector != "nixlv2":
        raise refuse("kv-connector", connector, "only nixlv2: P's blocks are released over NIXL")
    if given.get("ec-connector"):
        raise refuse("ec-connector", given["ec-connector"], "no encoder stage (E/P/D) is run here")
    if as_int("decode-chunk-size", given.get("decode-chunk-size", 0)):
        raise refuse("decode-chunk-size", given["decode-chunk-size"], "chunked decode is not supported")
    for flag in ("enable-speculative-prefill", "enable-p2p-pull"):
        if as_bool(flag, given.get(flag, False)):
            raise refuse(flag, given[flag], "not supported by this sidecar")
    for flag, value in given.items():
        if flag.startswith(MORIIO_PREFIX):
            raise refuse(flag, value, "MoRI-IO (WRITE mode, Wide-EP) is not supported by this sidecar")
    for flag in ("enable-tls", "tls-insecure-skip-verify"):
        for stage in as_list(given.get(flag, [])):
            if stage not in STAGES:
                raise refuse(flag, stage, "stages must be one of prefiller, decoder, encoder")


def _serving(given: Mapping[str, Any], out: dict[str, Any]) -> None:
    if "port" in given:
        out["port"] = as_int("port", given["port"])
    if "data-parallel-size" in given:
        out["data_parallel_size"] = as_int("data-parallel-size", given["data-parallel-size"])
    tls_flag = "secure-serving" if "secure-serving" in given else "secure-proxy"
    if tls_flag in given:
        out["tls"] = as_bool(tls_flag, given[tls_flag])
    if given.get("cert-path"):
        out["tls_cert_dir"] = str(given["cert-path"])
    if "tls-min-version" in given:
        version = str(given["tls-min-version"])
        if version not in TLS_VERSIONS:
            raise refuse(
                "tls-min-version", version, "must be VersionTLS12 or VersionTLS13 (TLS 1.2 is the minimum)"
            )
        out["tls_min_version"] = TLS_VERSIONS[version]
    if "tls-cipher-suites" in given:
        out["tls_ciphers"] = as_list(given["tls-cipher-suites"])
    if given.get("metrics-port"):
        out["admin_port"] = as_int("metrics-port", given["metrics-port"])
    if given.get("metrics-cert-dir"):
        out["admin_tls_cert_dir"] = str(given["metrics-cert-dir"])


def _routing(given: Mapping[str, Any], out: dict[str, Any]) -> None:
    enabled, insecure = (
        as_list(given.get("enable-tls", [])),
        as_list(given.get("tls-insecure-skip-verify", [])),
    )
    port_flag = "model-server-port" if "model-server-port" in given else "vllm-port"
    if port_flag in given or "decoder" in enabled:
        port = as_int(port_flag, given.get(port_flag, 8200))
        out["decode_url"] = f"{'https' if 'decoder' in enabled else 'http'}://localhost:{port}"
    if "prefiller" in enabled:
        out["prefill_tls"] = True
    if insecure:
        out["prefill_tls_insecure"], out["decode_tls_insecure"] = (
            "prefiller" in insecure,
            "decoder" in insecure,
        )
    if "enable-prefiller-sampling" in given:
        random = as_bool("enable-prefiller-sampling", given["enable-prefiller-sampling"])
        out["prefill_policy"] = "random" if random else "first"
    ssrf = as_bool("enable-ssrf-protection", given.get("enable-ssrf-protection", False))
    pool = str(given.get("inference-pool", ""))
    if ssrf:
        if not pool:
            raise refuse("enable-ssrf-protection", True, "needs --inference-pool or INFERENCE_POOL")
        out["inference_pool"] = pool if "/" in pool else f"default/{pool}"
    if "pool-group" in given:
        out["pool_group"] = str(given["pool-group"])
    if "max-idle-conns-per-host" in given:
        out["pool_size"] = as_int("max-idle-conns-per-host", given["max-idle-conns-per-host"])
    if "prefill-max-retries" in given:
        out["prefill_max_retries"] = as_int("prefill-max-retries", given["prefill-max-retries"])
    if "prefill-retry-backoff" in given:
        out["prefill_retry_backoff"] = duration("prefill-retry-backoff", str(given["prefill-retry-backoff"]))


def _observability(given: Mapping[str, Any], out: dict[str, Any], environ: Mapping[str, str]) -> None:
    if as_bool("tracing", given.get("tracing", False)):
        endpoint = environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or environ.get(
            "OTEL_EXPORTER_OTLP_ENDPOINT"
        )
        out["otlp_traces_endpoint"] = endpoint or "http://localhost:4318"
    if as_bool("zap-devel", given.get("zap-devel", False)):
        out["log_level"], out["log_format"] = "debug", "text"
    if "zap-log-level" in given:
        level = str(given["zap-log-level"]).lower()
        if level.isdigit():
            out["log_level"] = "debug" if int(level) > 0 else "info"
        elif level in ZAP_LEVELS:
            out["log_level"] = ZAP_LEVELS[level]
        else:
            raise refuse("zap-log-level", level, "must be debug, info, error, panic or a verbosity number")
    if "zap-encoder" in given:
        encoder = str(given["zap-encoder"])
        if encoder not in ("json", "console"):
            raise refuse("zap-encoder", encoder, "must be json or console")
        out["log_format"] = "json" if encoder == "json" else "text"
