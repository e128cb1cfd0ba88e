"""Every flag of llm-d's ``pd-sidecar``, the release it appeared in, and the settings it maps to.

Read from llm-d's sources tag by tag: ``cmd/pd-sidecar/main.go`` (v0.4.0 to
v0.6.x) and ``pkg/sidecar/proxy/options.go`` (v0.7.0 on) of
llm-d-inference-scheduler up to v0.8.0, then of llm-d-router (v0.9.0 and
v0.10.0, ``NEWEST_TAG``); the ``zap-*`` flags and ``--kubeconfig`` come from controller-runtime,
bound on the same command line. ``since`` is the first of those tags with the
flag. ``MAPPING`` is the table docs/llm-d.md shows and tests check row by row;
``EXTRA`` holds flags other llm-d components take (the endpoint picker's TLS
and metrics flags) that this sidecar also accepts, outside that table.
"""

from __future__ import annotations

from typing import NamedTuple


class Flag(NamedTuple):
    kind: str  # int, str, bool, list or duration: how pflag reads the value
    since: str  # the first llm-d tag whose pd-sidecar has it
    effect: str  # the settings it sets here (the docs table's last column)


# The newest llm-d tag whose pd-sidecar flags are all in MAPPING (read from its options.go).
NEWEST_TAG = "v0.10.0"

_MORIIO = 'MoRI-IO: accepted; releases off (kvr_releases_enabled{reason="moriio"})'

MAPPING: dict[str, Flag] = {
    "port": Flag("int", "v0.4.0", "port (rank 0; ranks above on port + rank)"),
    "model-server-port": Flag("int", "v0.10.0", "decode_url = http(s)://localhost:PORT"),
    "vllm-port": Flag("int", "v0.4.0", "decode_url, as --model-server-port (deprecated in v0.10.0)"),
    "data-parallel-size": Flag("int", "v0.4.0", "data_parallel_size"),
    "kv-connector": Flag("str", "v0.7.0", "nixlv2: release = nixl; another: release = off, prefill_leg"),
    "connector": Flag("str", "v0.4.0", "as --kv-connector (deprecated in v0.7.0, gone in v0.10.0)"),
    "ec-connector": Flag("str", "v0.7.0", "set: release = off (no encoder stage here)"),
    "secure-proxy": Flag("bool", "v0.4.0", "tls"),
    "cert-path": Flag("str", "v0.4.0", "tls_cert_dir"),
    "enable-tls": Flag("list", "v0.7.0", "prefiller: prefill_tls; decoder: decode_url https"),
    "tls-insecure-skip-verify": Flag("list", "v0.7.0", "prefill_tls_insecure, decode_tls_insecure"),
    "prefiller-use-tls": Flag("bool", "v0.4.0", "prefill_tls, as --enable-tls=prefiller (gone in v0.10.0)"),
    "decoder-use-tls": Flag("bool", "v0.4.0", "decode_url https, as --enable-tls=decoder (gone in v0.10.0)"),
    "prefiller-tls-insecure-skip-verify": Flag("bool", "v0.4.0", "prefill_tls_insecure (gone in v0.10.0)"),
    "decoder-tls-insecure-skip-verify": Flag("bool", "v0.4.0", "decode_tls_insecure (gone in v0.10.0)"),
    "enable-ssrf-protection": Flag("bool", "v0.4.0", "inference_pool required; off: prefill_allow_default"),
    "inference-pool": Flag("str", "v0.7.0", "inference_pool (name alone: default/name)"),
    "inference-pool-namespace": Flag("str", "v0.4.0", "inference_pool's namespace (gone in v0.9.0)"),
    "inference-pool-name": Flag("str", "v0.4.0", "inference_pool's name (gone in v0.9.0)"),
    "pool-group": Flag("str", "v0.5.0", "pool_group"),
    "max-idle-conns-per-host": Flag("int", "v0.8.0", "pool_size"),
    "prefill-max-retries": Flag("int", "v0.9.0", "prefill_max_retries"),
    "prefill-retry-backoff": Flag("duration", "v0.9.0", "prefill_retry_backoff"),
    "decode-chunk-size": Flag("int", "v0.9.0", "refused unless 0"),
    "enable-prefiller-sampling": Flag("bool", "v0.4.0", "prefill_policy = random (else first)"),
    "enable-p2p-pull": Flag("bool", "v0.10.0", "refused when on"),
    "mooncake-bootstrap-port": Flag("int", "v0.9.0", "no effect (no mooncake protocol here)"),
    "p2p-connector-port": Flag("int", "v0.10.0", "no effect (no P2P pulls here)"),
    "tracing": Flag("bool", "v0.9.0", "otlp_traces_endpoint, trace_sample_ratio from OTEL_* variables"),
    "metrics-port": Flag("int", "v0.10.0", "admin_port (when not 0)"),
    "configuration": Flag("str", "v0.9.0", "the same settings as YAML, inline"),
    "configuration-file": Flag("str", "v0.9.0", "the same settings as a YAML file"),
    "zap-log-level": Flag("str", "v0.4.0", "log_level"),
    "zap-encoder": Flag("str", "v0.4.0", "log_format (console: text)"),
    "zap-devel": Flag("bool", "v0.4.0", "log_level debug, log_format text"),
    "zap-stacktrace-level": Flag("str", "v0.4.0", "accepted; tracebacks are logged with errors"),
    "zap-time-encoding": Flag("str", "v0.4.0", "accepted; timestamps are ISO 8601"),
    "kubeconfig": Flag("str", "v0.4.0", "accepted (until v0.8.x); the watch uses the service account"),
    "moriio-write-mode": Flag("bool", "v0.9.0", _MORIIO + "; on: prefill_leg = skip"),
    "moriio-decode-notify-port": Flag("int", "v0.9.0", _MORIIO),
    "moriio-local-pod-ip": Flag("str", "v0.9.0", _MORIIO),
    "moriio-decode-handshake-port": Flag("int", "v0.9.0", _MORIIO),
    "moriio-parallel-dispatch": Flag("bool", "v0.9.0", _MORIIO),
    "moriio-parallel-decode-wait-timeout": Flag("duration", "v0.10.0", _MORIIO),
    "moriio-prefill-handshake-port": Flag("int", "v0.9.0", _MORIIO),
    "moriio-prefill-notify-port": Flag("int", "v0.9.0", _MORIIO),
    "moriio-tp-size": Flag("int", "v0.9.0", _MORIIO),
    "moriio-dp-size": Flag("int", "v0.9.0", _MORIIO),
    "moriio-remote-hosts": Flag("list", "v0.9.0", _MORIIO),
    "moriio-dp-size-local": Flag("int", "v0.9.0", _MORIIO),
    "moriio-decode-hosts": Flag("list", "v0.9.0", _MORIIO),
}

# Not pd-sidecar's (the endpoint picker's, in llm-d-router's pkg/epp/server/options.go), accepted
# because llm-d manifests pass --secure-serving to the routing sidecar and they do something useful.
EXTRA: dict[str, Flag] = {
    "secure-serving": Flag("bool", "", "tls, as --secure-proxy"),
    "tls-min-version": Flag("str", "", "tls_min_version"),
    "tls-cipher-suites": Flag("list", "", "tls_ciphers"),
    "metrics-cert-dir": Flag("str", "", "admin_tls_cert_dir"),
}
FLAGS: dict[str, Flag] = {**MAPPING, **EXTRA}
MORIIO_PREFIX = "moriio-"
# --kv-connector values llm-d's sidecar accepts in some tag; only nixlv2 is run and released here.
# lmcache: --connector's other value from v0.4.0 to v0.5.1 (its P leg only warms the cache D reads).
KV_CONNECTORS = ("nixlv2", "shared-storage", "sglang", "mooncake", "offloading", "lmcache")
