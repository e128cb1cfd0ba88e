"""llm-d's flags onto this sidecar's settings, as exact tables (``sidecar.llmd.flags.settings``).

``tests/unit/test_llmd_flags.py`` goes through the command line; here the
mapping function is called with flag values as pflag hands them over (text)
and as a YAML ``--configuration`` gives them (typed), and each row states the
whole result: every setting a flag sets, and nothing else. A flag that cannot
be honoured is refused with the exact message an operator reads.
"""

from __future__ import annotations

from typing import Any

import pytest

from sidecar.config import ConfigError
from sidecar.llmd.flags import as_bool, as_int, as_list, duration, settings

ROWS: list[tuple[dict[str, Any], dict[str, str], dict[str, Any]]] = [
    ({}, {}, {}),
    ({}, {"POD_IP": " 10.1.2.3 "}, {"pod_ip": "10.1.2.3"}),
    ({"port": "8000"}, {}, {"port": 8000}),
    ({"data-parallel-size": "2"}, {}, {"data_parallel_size": 2}),
    ({"secure-serving": "true"}, {}, {"tls": True}),
    ({"secure-serving": "false", "secure-proxy": "true"}, {}, {"tls": False}),  # the newer flag wins
    ({"secure-proxy": "true"}, {}, {"tls": True}),
    ({"cert-path": "/certs"}, {}, {"tls_cert_dir": "/certs"}),
    ({"cert-path": ""}, {}, {}),
    ({"tls-min-version": "VersionTLS13"}, {}, {"tls_min_version": "1.3"}),
    ({"tls-min-version": "VersionTLS12"}, {}, {"tls_min_version": "1.2"}),
    ({"tls-cipher-suites": "A, B,"}, {}, {"tls_ciphers": ["A", "B"]}),
    ({"metrics-port": "9090"}, {}, {"admin_port": 9090}),
    ({"metrics-port": 0}, {}, {}),  # from a YAML --configuration
    ({"metrics-cert-dir": "/m"}, {}, {"admin_tls_cert_dir": "/m"}),
    ({"model-server-port": "8001"}, {}, {"decode_url": "http://localhost:8001"}),
    ({"model-server-port": "8001", "vllm-port": "9"}, {}, {"decode_url": "http://localhost:8001"}),
    ({"vllm-port": "8002"}, {}, {"decode_url": "http://localhost:8002"}),
    ({"enable-tls": "decoder"}, {}, {"decode_url": "https://localhost:8200"}),
    ({"enable-tls": "prefiller"}, {}, {"prefill_tls": True}),
    (
        {"enable-tls": ["decoder", "prefiller"], "vllm-port": 8003},
        {},
        {"decode_url": "https://localhost:8003", "prefill_tls": True},
    ),
    (
        {"tls-insecure-skip-verify": "prefiller"},
        {},
        {"prefill_tls_insecure": True, "decode_tls_insecure": False},
    ),
    (
        {"tls-insecure-skip-verify": "decoder"},
        {},
        {"prefill_tls_insecure": False, "decode_tls_insecure": True},
    ),
    ({"enable-prefiller-sampling": "true"}, {}, {"prefill_policy": "random"}),
    ({"enable-prefiller-sampling": "false"}, {}, {"prefill_policy": "first"}),
    ({}, {"ENABLE_PREFILLER_SAMPLING": " True "}, {"prefill_policy": "random"}),
    ({}, {"ENABLE_PREFILLER_SAMPLING": "0"}, {"prefill_policy": "first"}),
    ({}, {"ENABLE_PREFILLER_SAMPLING": "1"}, {"prefill_policy": "random"}),
    ({}, {"ENABLE_PREFILLER_SAMPLING": "t"}, {"prefill_policy": "random"}),
    ({}, {"ENABLE_PREFILLER_SAMPLING": "T"}, {"prefill_policy": "random"}),
    ({}, {"ENABLE_PREFILLER_SAMPLING": "f"}, {"prefill_policy": "first"}),
    ({}, {"ENABLE_PREFILLER_SAMPLING": "false"}, {"prefill_policy": "first"}),
    ({}, {"ENABLE_PREFILLER_SAMPLING": "FALSE"}, {"prefill_policy": "first"}),
    ({}, {"ENABLE_PREFILLER_SAMPLING": "maybe"}, {}),  # not a boolean: llm-d ignores it too
    ({"enable-prefiller-sampling": "false"}, {"ENABLE_PREFILLER_SAMPLING": "1"}, {"prefill_policy": "first"}),
    ({"enable-ssrf-protection": "true", "inference-pool": "pool"}, {}, {"inference_pool": "default/pool"}),
    ({"enable-ssrf-protection": "true", "inference-pool": "ns/pool"}, {}, {"inference_pool": "ns/pool"}),
    ({"enable-ssrf-protection": "true"}, {"INFERENCE_POOL": "p2"}, {"inference_pool": "default/p2"}),
    (
        {"enable-ssrf-protection": "true", "inference-pool": "a"},
        {"INFERENCE_POOL": "b"},
        {"inference_pool": "default/a"},
    ),
    ({"inference-pool": "pool"}, {}, {}),  # without SSRF protection the pool is not read
    ({"pool-group": "inference.networking.k8s.io"}, {}, {"pool_group": "inference.networking.k8s.io"}),
    ({"max-idle-conns-per-host": "64"}, {}, {"pool_size": 64}),
    ({"prefill-max-retries": "3"}, {}, {"prefill_max_retries": 3}),
    ({"prefill-retry-backoff": "1m30s"}, {}, {"prefill_retry_backoff": 90.0}),
    ({"tracing": "true"}, {}, {"otlp_traces_endpoint": "http://localhost:4318"}),
    (
        {"tracing": "true"},
        {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://otel:4318"},
        {"otlp_traces_endpoint": "http://otel:4318"},
    ),
    (
        {"tracing": "true"},
        {
            "OTEL_EXPORTER_OTLP_ENDPOINT": "http://otel:4318",
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://t:4318",
        },
        {"otlp_traces_endpoint": "http://t:4318"},
    ),
    ({"tracing": "false"}, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://otel:4318"}, {}),
    ({"zap-devel": "true"}, {}, {"log_level": "debug", "log_format": "text"}),
    ({"zap-devel": "true", "zap-log-level": "error"}, {}, {"log_level": "error", "log_format": "text"}),
    ({"zap-log-level": "WARN"}, {}, {"log_level": "warning"}),
    ({"zap-log-level": "dpanic"}, {}, {"log_level": "error"}),
    ({"zap-log-level": "3"}, {}, {"log_level": "debug"}),
    ({"zap-log-level": "1"}, {}, {"log_level": "debug"}),
    ({"zap-log-level": "0"}, {}, {"log_level": "info"}),
    ({"zap-encoder": "json"}, {}, {"log_format": "json"}),
    ({"zap-encoder": "console"}, {}, {"log_format": "text"}),
    ({"zap-devel": "true", "zap-encoder": "json"}, {}, {"log_level": "debug", "log_format": "json"}),
    # accepted and without effect here, as in llm-d with nixlv2
    ({"kv-connector": "nixlv2", "ec-connector": "", "decode-chunk-size": "0"}, {}, {}),
    ({"enable-speculative-prefill": "false", "enable-p2p-pull": "false"}, {}, {}),
    ({"mooncake-bootstrap-port": "8998", "p2p-connector-port": "1"}, {}, {}),
]


@pytest.mark.parametrize(("given", "environ", "expected"), ROWS)
def test_flags_set_exactly_these_settings(
    given: dict[str, Any], environ: dict[str, str], expected: dict[str, Any]
) -> None:
    assert settings(given, environ) == expected


# (flag, value given, the value as the message shows it, the reason)
NOT_HERE = "not supported by this sidecar"
STAGES = "stages must be one of prefiller, decoder, encoder"
WHOLE, BOOL = "must be a whole number", "must be true or false"
REFUSALS: list[tuple[str, str, str, str]] = [
    ("kv-connector", "lmcache", "'lmcache'", "only nixlv2: P's blocks are released over NIXL"),
    ("ec-connector", "ec-example", "'ec-example'", "no encoder stage (E/P/D) is run here"),
    ("decode-chunk-size", "512", "'512'", "chunked decode is not supported"),
    ("decode-chunk-size", "x", "'x'", WHOLE),
    ("enable-speculative-prefill", "true", "'true'", NOT_HERE),
    ("enable-p2p-pull", "1", "'1'", NOT_HERE),
    ("moriio-mode", "write", "'write'", f"MoRI-IO (WRITE mode, Wide-EP) is {NOT_HERE}"),
    ("enable-tls", "decoder,cache", "'cache'", STAGES),
    ("tls-insecure-skip-verify", "p", "'p'", STAGES),
    (
        "tls-min-version",
        "VersionTLS11",
        "'VersionTLS11'",
        "must be VersionTLS12 or VersionTLS13 (TLS 1.2 is the minimum)",
    ),
    ("port", "eighty", "'eighty'", WHOLE),
    ("secure-serving", "yes", "'yes'", BOOL),
    ("secure-proxy", "yes", "'yes'", BOOL),
    ("vllm-port", "x", "'x'", WHOLE),
    ("enable-ssrf-protection", "true", "True", "needs --inference-pool or INFERENCE_POOL"),
    ("prefill-retry-backoff", "1 s", "'1 s'", "must be a duration such as 200ms, 1s or 1m30s"),
    ("zap-log-level", "loud", "'loud'", "must be debug, info, error, panic or a verbosity number"),
    ("zap-encoder", "xml", "'xml'", "must be json or console"),
    ("metrics-port", "x", "'x'", WHOLE),
    ("tracing", "on", "'on'", BOOL),
    ("zap-devel", "on", "'on'", BOOL),
    ("data-parallel-size", "two", "'two'", WHOLE),
    ("max-idle-conns-per-host", "many", "'many'", WHOLE),
    ("prefill-max-retries", "x", "'x'", WHOLE),
    ("enable-prefiller-sampling", "maybe", "'maybe'", BOOL),
    ("enable-ssrf-protection", "maybe", "'maybe'", BOOL),
    ("enable-speculative-prefill", "maybe", "'maybe'", BOOL),
    ("enable-p2p-pull", "maybe", "'maybe'", BOOL),
]


@pytest.mark.parametrize(("flag", "value", "shown", "reason"), REFUSALS)
def test_what_cannot_be_honoured_is_refused_with_the_reason(
    flag: str, value: str, shown: str, reason: str
) -> None:
    with pytest.raises(ConfigError) as refused:
        settings({flag: value}, {})
    assert str(refused.value) == f"invalid {flag} (--{flag}) = {shown}: {reason}"


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("200ms", 0.2),
        ("1s", 1.0),
        ("1m30s", 90.0),
        ("1h", 3600.0),
        ("1.5s", 1.5),
        ("10us", 1e-5),
        ("10µs", 1e-5),
        ("3ns", 3e-9),
    ],
)
def test_go_durations_in_every_unit(text: str, seconds: float) -> None:
    assert duration("prefill-retry-backoff", text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "1", "s", "1s ", "1x", "1sfoo"])
def test_what_is_not_a_go_duration(text: str) -> None:
    with pytest.raises(ConfigError, match="must be a duration"):
        duration("prefill-retry-backoff", text)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("1", True),
        ("t", True),
        ("TRUE", True),
        (" true ", True),
        (True, True),
        ("0", False),
        ("f", False),
        ("False", False),
        (False, False),
    ],
)
def test_pflag_booleans(value: object, expected: bool) -> None:
    assert as_bool("tracing", value) is expected


def test_whole_numbers_and_lists() -> None:
    assert as_int("port", "8000") == 8000 and as_int("port", 7) == 7
    assert as_list(" a, b ,,c ") == ["a", "b", "c"]
    assert as_list(["a ", " ", "b"]) == ["a", "b"]
    assert as_list("") == []
