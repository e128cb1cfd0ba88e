"""llm-d's routing-sidecar command line, read into this project's settings.

Every flag of llm-d's ``pd-sidecar`` from v0.4.0 on (``sidecar.llmd.table``) is
accepted in pflag's forms (``--name=value``, ``--name value``, a switch alone or
``--name=false``), with the environment variables llm-d reads
(``INFERENCE_POOL``, ``INFERENCE_POOL_NAMESPACE``, ``INFERENCE_POOL_NAME``,
``ENABLE_PREFILLER_SAMPLING``, ``POD_IP``, the ``OTEL_*`` ones with
``--tracing``; ``SSL_CERT_DIR``, ``SSL_CERT_FILE``, ``OTEL_SERVICE_NAME`` and
``OTEL_RESOURCE_ATTRIBUTES`` are read by ``sidecar.config`` for both commands)
and its ``--configuration``/``--configuration-file`` YAML (strict; flags win).
``settings`` maps them onto ``Config`` fields. A P/D protocol this sidecar does
not run (another KV connector, an encoder stage, MoRI-IO) keeps the pod serving
with releases off and a note; what it cannot honour at all (chunked decode, P2P
pulls, an unknown value) raises ``ConfigError`` naming the flag and why.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from sidecar import extras
from sidecar.config import ConfigError
from sidecar.llmd.table import KV_CONNECTORS, MORIIO_PREFIX

STAGES = ("prefiller", "decoder", "encoder")
TLS_VERSIONS = {"VersionTLS12": "1.2", "VersionTLS13": "1.3"}
ZAP_LEVELS = {"debug": "debug", "info": "info", "warn": "warning", "error": "error", "dpanic": "error"}
ZAP_LEVELS |= {"panic": "error", "fatal": "error"}
# llm-d's verbosity levels (pkg/common/observability/logging/const.go): V(1) to V(3) are info, V(4) debug.
ZAP_DEBUG_VERBOSITY = 4
# The older flags that each add one stage to --enable-tls or --tls-insecure-skip-verify (v0.4.0 to v0.9.x).
STAGE_FLAGS = {
    "prefiller-use-tls": ("enable-tls", "prefiller"),
    "decoder-use-tls": ("enable-tls", "decoder"),
    "prefiller-tls-insecure-skip-verify": ("tls-insecure-skip-verify", "prefiller"),
    "decoder-tls-insecure-skip-verify": ("tls-insecure-skip-verify", "decoder"),
}
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


def settings(
    given: Mapping[str, Any], environ: Mapping[str, str], notes: list[str] | None = None
) -> dict[str, Any]:
    """The ``Config`` values llm-d's flags ask for (``given``: flag name -> raw value); what runs
    differently from llm-d (another P/D protocol, tracing) is told in ``notes``, logged at start."""
    notes = notes if notes is not None else []
    given = _stages({**_from_env(environ), **given})
    _refusals(given)
    out: dict[str, Any] = {"pod_ip": environ["POD_IP"].strip()} if environ.get("POD_IP") else {}
    _serving(given, out)
    _routing(given, out)
    _pool(given, out)
    _protocol(given, out, notes)
    _observability(given, out, environ, notes)
    return out


def _from_env(environ: Mapping[str, str]) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for variable, flag in (
        ("INFERENCE_POOL", "inference-pool"),
        ("INFERENCE_POOL_NAMESPACE", "inference-pool-namespace"),
        ("INFERENCE_POOL_NAME", "inference-pool-name"),
    ):
        if environ.get(variable):
            found[flag] = environ[variable]
    sampling = environ.get("ENABLE_PREFILLER_SAMPLING", "").strip().lower()
    if sampling in ("1", "t", "true", "0", "f", "false"):
        found["enable-prefiller-sampling"] = sampling
    return found


def _stages(given: dict[str, Any]) -> dict[str, Any]:
    """The older per-stage switches folded into --enable-tls and --tls-insecure-skip-verify."""
    for flag, (into, stage) in STAGE_FLAGS.items():
        if flag in given and as_bool(flag, given[flag]):
            given[into] = [*as_list(given.get(into, [])), stage]
    return given


def _refusals(given: Mapping[str, Any]) -> None:
    if as_int("decode-chunk-size", given.get("decode-chunk-size", 0)):
        raise refuse("decode-chunk-size", given["decode-chunk-size"], "chunked decode is not supported")
    if as_bool("enable-p2p-pull", given.get("enable-p2p-pull", False)):
        raise refuse("enable-p2p-pull", given["enable-p2p-pull"], "P2P pulls are not supported here")
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
    if given.get("metrics-port") and as_int("metrics-port", given["metrics-port"]):
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
    if "max-idle-conns-per-host" in given:
        out["pool_size"] = as_int("max-idle-conns-per-host", given["max-idle-conns-per-host"])
    if "prefill-max-retries" in given:
        out["prefill_max_retries"] = as_int("prefill-max-retries", given["prefill-max-retries"])
    if "prefill-retry-backoff" in given:
        out["prefill_retry_backoff"] = duration("prefill-retry-backoff", str(given["prefill-retry-backoff"]))


def _pool(given: Mapping[str, Any], out: dict[str, Any]) -> None:
    """--inference-pool (or INFERENCE_POOL) over the older namespace and name flags and variables."""
    if "pool-group" in given:
        out["pool_group"] = str(given["pool-group"])
    if not as_bool("enable-ssrf-protection", given.get("enable-ssrf-protection", False)):
        return
    pool = str(given.get("inference-pool", ""))
    if pool:
        out["inference_pool"] = pool if "/" in pool else f"default/{pool}"
        return
    namespace = str(given.get("inference-pool-namespace", ""))
    name = str(given.get("inference-pool-name", ""))
    if not namespace or not name:
        missing = "--inference-pool-name or INFERENCE_POOL_NAME" if namespace else "a namespace"
        reason = f"needs --inference-pool or INFERENCE_POOL ({missing} missing)"
        raise refuse("enable-ssrf-protection", True, reason)
    out["inference_pool"] = f"{namespace}/{name}"


def _protocol(given: Mapping[str, Any], out: dict[str, Any], notes: list[str]) -> None:
    """Another P/D protocol than nixlv2: the pod keeps serving, with releases off (and why)."""
    flag = "kv-connector" if given.get("kv-connector") else "connector"
    connector = str(given.get(flag) or "nixlv2")
    if connector not in KV_CONNECTORS:
        raise refuse(flag, connector, "must be one of " + ", ".join(KV_CONNECTORS))
    moriio = sorted(f for f in given if f.startswith(MORIIO_PREFIX))
    if connector != "nixlv2":
        out["prefill_leg"] = "refuse" if connector == "sglang" else "skip"
        _off(out, notes, "kv_connector", f"--{flag}={connector}: {_LEGS[out['prefill_leg']]}")
    elif moriio:
        if as_bool("moriio-write-mode", given.get("moriio-write-mode", False)):
            out["prefill_leg"] = "skip"
        leg = _LEGS[out.get("prefill_leg", "nixlv2")]
        _off(out, notes, "moriio", f"--{moriio[0]} (MoRI-IO): {leg}")
    if given.get("ec-connector") and "releases_off_for" not in out:
        leg = _LEGS[out.get("prefill_leg", "nixlv2")]
        reason = f"--ec-connector={given['ec-connector']}: no encoder stage here, {leg}"
        _off(out, notes, "ec_connector", reason)


_LEGS = {
    "nixlv2": "the prefill leg runs as with nixlv2",
    "skip": "requests naming a P go to D alone, which prefills them itself",
    "refuse": "requests naming a P are refused (501): its protocol is not implemented here",
}


def _off(out: dict[str, Any], notes: list[str], reason: str, detail: str) -> None:
    out["release"], out["releases_off_for"] = "off", reason
    notes.append(f"{detail}; releases are off: this sidecar releases P's blocks for nixlv2 only")


def _observability(
    given: Mapping[str, Any], out: dict[str, Any], environ: Mapping[str, str], notes: list[str]
) -> None:
    if as_bool("tracing", given.get("tracing", False)):
        _tracing(out, environ, notes)
    if as_bool("zap-devel", given.get("zap-devel", False)):
        out["log_level"], out["log_format"] = "debug", "text"
    if "zap-log-level" in given:
        level = str(given["zap-log-level"]).lower()
        if level.isdigit():  # a verbosity: V(N) and below are logged
            out["log_level"] = "debug" if int(level) >= ZAP_DEBUG_VERBOSITY else "info"
        elif level in ZAP_LEVELS:
            out["log_level"] = ZAP_LEVELS[level]
        else:
            raise refuse("zap-log-level", level, "must be debug, info, error, panic or a verbosity number")
    if "zap-encoder" in given:
        encoder = str(given["zap-encoder"])
        if encoder not in ("json", "console"):
            raise refuse("zap-encoder", encoder, "must be json or console")
        out["log_format"] = "json" if encoder == "json" else "text"


def _tracing(out: dict[str, Any], environ: Mapping[str, str], notes: list[str]) -> None:
    """llm-d's --tracing: OTLP with OTEL_TRACES_EXPORTER=otlp, else a console exporter; the
    OTEL_TRACES_SAMPLER_ARG ratio (0.1). A missing piece turns tracing off, never the start."""
    if environ.get("OTEL_TRACES_EXPORTER", "console").strip().lower() != "otlp":
        notes.append(
            "--tracing: llm-d's console exporter (OTEL_TRACES_EXPORTER unset or not otlp) is not "
            "offered: spans on stdout would mix with the logs; tracing is off (set OTEL_TRACES_EXPORTER=otlp)"
        )
        return
    missing = extras.missing_module("otel")
    if missing is not None:
        notes.append(f"--tracing: the otel extra is not installed (no module {missing}); tracing is off")
        return
    endpoint = environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    if not endpoint or endpoint.rstrip("/").endswith(":4317"):
        notes.append(
            "--tracing: spans go by OTLP over HTTP (port 4318), not gRPC (4317) as llm-d's: "
            "point OTEL_EXPORTER_OTLP_TRACES_ENDPOINT at the collector's OTLP/HTTP port"
        )
    out["otlp_traces_endpoint"] = endpoint or "http://localhost:4318"
    out["trace_sample_ratio"] = _ratio(environ)


def _ratio(environ: Mapping[str, str]) -> float:
    """OTEL_TRACES_SAMPLER_ARG for llm-d's parentbased_traceidratio sampler; 0.1 otherwise."""
    if environ.get("OTEL_TRACES_SAMPLER", "parentbased_traceidratio") != "parentbased_traceidratio":
        return 0.1
    try:
        ratio = float(environ.get("OTEL_TRACES_SAMPLER_ARG", "0.1"))
    except ValueError:
        return 0.1
    return ratio if 0.0 <= ratio <= 1.0 else 0.1
