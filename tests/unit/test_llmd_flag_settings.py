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
from sidecar.llmd.table import KV_CONNECTORS

OTLP = {"OTEL_TRACES_EXPORTER": "otlp"}
TRACED = {"otlp_traces_endpoint": "http://localhost:4318"}
OFF = {"release": "off"}
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
    ({"metrics-port": 0}, {}, {}),  # from a YAML --configuration: "when not 0"
    ({"metrics-port": "0"}, {}, {}),  # the same as text on the command line
    ({"metrics-port": ""}, {}, {}),
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
    ({"tracing": "true"}, {}, {}),  # llm-d's console exporter: off, with a note (tested below)
    ({"tracing": "true"}, OTLP, {"otlp_traces_endpoint": "http://localhost:4318", "trace_sample_ratio": 0.1}),
    (
        {"tracing": "true"},
        {**OTLP, "OTEL_EXPORTER_OTLP_ENDPOINT": "http://otel:4318"},
        {"otlp_traces_endpoint": "http://otel:4318", "trace_sample_ratio": 0.1},
    ),
    (
        {"tracing": "true"},
        {
            **OTLP,
            "OTEL_EXPORTER_OTLP_ENDPOINT": "http://otel:4318",
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://t:4318",
            "OTEL_TRACES_SAMPLER_ARG": "0.25",
        },
        {"otlp_traces_endpoint": "http://t:4318", "trace_sample_ratio": 0.25},
    ),
    ({"tracing": "true"}, {**OTLP, "OTEL_TRACES_SAMPLER_ARG": "2"}, {**TRACED, "trace_sample_ratio": 0.1}),
    ({"tracing": "true"}, {**OTLP, "OTEL_TRACES_SAMPLER_ARG": "x"}, {**TRACED, "trace_sample_ratio": 0.1}),
    ({"tracing": "true"}, {**OTLP, "OTEL_TRACES_SAMPLER_ARG": "1"}, {**TRACED, "trace_sample_ratio": 1.0}),
    ({"tracing": "true"}, {**OTLP, "OTEL_TRACES_SAMPLER_ARG": "0"}, {**TRACED, "trace_sample_ratio": 0.0}),
    ({"tracing": "false"}, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://otel:4318"}, {}),
    ({"zap-devel": "true"}, {}, {"log_level": "debug", "log_format": "text"}),
    ({"zap-devel": "true", "zap-log-level": "error"}, {}, {"log_level": "error", "log_format": "text"}),
    ({"zap-log-level": "WARN"}, {}, {"log_level": "warning"}),
    ({"zap-log-level": "dpanic"}, {}, {"log_level": "error"}),
    ({"zap-log-level": "4"}, {}, {"log_level": "debug"}),  # llm-d's DEBUG verbosity
    ({"zap-log-level": "3"}, {}, {"log_level": "info"}),  # VERBOSE: still info
    ({"zap-log-level": "1"}, {}, {"log_level": "info"}),
    ({"zap-log-level": "0"}, {}, {"log_level": "info"}),
    ({"zap-encoder": "json"}, {}, {"log_format": "json"}),
    ({"zap-encoder": "console"}, {}, {"log_format": "text"}),
    ({"zap-devel": "true", "zap-encoder": "json"}, {}, {"log_level": "debug", "log_format": "json"}),
    # accepted and without effect here, as in llm-d with nixlv2
    ({"kv-connector": "nixlv2", "ec-connector": "", "decode-chunk-size": "0"}, {}, {}),
    ({"connector": "nixlv2", "kv-connector": ""}, {}, {}),
    ({"enable-p2p-pull": "false"}, {}, {}),
    ({"mooncake-bootstrap-port": "8998", "p2p-connector-port": "1"}, {}, {}),
]


@pytest.mark.parametrize(("given", "environ", "expected"), ROWS)
def test_flags_set_exactly_these_settings(
    given: dict[str, Any], environ: dict[str, str], expected: dict[str, Any]
) -> None:
    assert settings(given, environ) == expected


# (flag, value given, the value as the message shows it, the reason)
STAGES = "stages must be one of prefiller, decoder, encoder"
WHOLE, BOOL = "must be a whole number", "must be true or false"
REFUSALS: list[tuple[str, str, str, str]] = [
    ("kv-connector", "dynamo", "'dynamo'", f"must be one of {', '.join(KV_CONNECTORS)}"),
    ("connector", "dynamo", "'dynamo'", f"must be one of {', '.join(KV_CONNECTORS)}"),
    ("decode-chunk-size", "512", "'512'", "chunked decode is not supported"),
    ("decode-chunk-size", "x", "'x'", WHOLE),
    ("enable-p2p-pull", "1", "'1'", "P2P pulls are not supported here"),
    ("enable-p2p-pull", "true", "'true'", "P2P pulls are not supported here"),
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
    (
        "enable-ssrf-protection",
        "true",
        "True",
        "needs --inference-pool or INFERENCE_POOL (a namespace missing)",
    ),
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
    ("moriio-write-mode", "maybe", "'maybe'", BOOL),
    ("prefiller-use-tls", "maybe", "'maybe'", BOOL),
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


NIXL_ONLY = "releases are off: this sidecar releases P's blocks for nixlv2 only"
SKIP = "requests naming a P go to D alone, which prefills them itself"
LEGS = "the prefill leg runs as with nixlv2"
# Another P/D protocol (docs/llm-d.md "Another P/D protocol"): served, releases off, one note.
OFF_ROWS: list[tuple[dict[str, Any], dict[str, Any], str]] = [
    (
        {"connector": "lmcache"},  # --connector's other value in v0.4.0 to v0.5.1
        {**OFF, "releases_off_for": "kv_connector", "prefill_leg": "skip"},
        f"--connector=lmcache: {SKIP}",
    ),
    (
        {"kv-connector": "sglang", "connector": "lmcache"},
        {**OFF, "releases_off_for": "kv_connector", "prefill_leg": "refuse"},
        "--kv-connector=sglang: requests naming a P are refused (501): its protocol is not implemented here",
    ),
    (
        {"kv-connector": "mooncake", "ec-connector": "ec-example", "moriio-tp-size": "2"},
        {**OFF, "releases_off_for": "kv_connector", "prefill_leg": "skip"},
        f"--kv-connector=mooncake: {SKIP}",
    ),
    (
        {"ec-connector": "ec-example"},
        {**OFF, "releases_off_for": "ec_connector"},
        f"--ec-connector=ec-example: no encoder stage here, {LEGS}",
    ),
    (
        {"moriio-tp-size": "2", "moriio-dp-size": "8"},
        {**OFF, "releases_off_for": "moriio"},
        f"--moriio-dp-size (MoRI-IO): {LEGS}",
    ),
    (
        {"moriio-write-mode": "true", "ec-connector": "e"},
        {**OFF, "releases_off_for": "moriio", "prefill_leg": "skip"},
        f"--moriio-write-mode (MoRI-IO): {SKIP}",
    ),
    (
        {"moriio-write-mode": "false"},
        {**OFF, "releases_off_for": "moriio"},
        f"--moriio-write-mode (MoRI-IO): {LEGS}",
    ),
]


@pytest.mark.parametrize(("given", "expected", "note"), OFF_ROWS)
def test_another_protocol_serves_with_releases_off_and_says_why(
    given: dict[str, Any], expected: dict[str, Any], note: str
) -> None:
    notes: list[str] = []
    assert settings(given, {}, notes) == expected
    assert notes == [f"{note}; {NIXL_ONLY}"]


POOL_ROWS: list[tuple[dict[str, Any], dict[str, str], str]] = [
    (
        {"enable-ssrf-protection": "true"},
        {"INFERENCE_POOL_NAMESPACE": "ns", "INFERENCE_POOL_NAME": "p"},
        "ns/p",
    ),
    (
        {"enable-ssrf-protection": "1", "inference-pool-namespace": "ns", "inference-pool-name": "q"},
        {},
        "ns/q",
    ),
    (
        {"enable-ssrf-protection": "true", "inference-pool-name": "q"},
        {"INFERENCE_POOL_NAMESPACE": "ns"},
        "ns/q",
    ),
]


@pytest.mark.parametrize(("given", "environ", "pool"), POOL_ROWS)
def test_the_older_pool_flags_and_variables(
    given: dict[str, Any], environ: dict[str, str], pool: str
) -> None:
    assert settings(given, environ) == {"inference_pool": pool}


def test_a_pool_namespace_without_its_name_is_refused_naming_the_missing_one() -> None:
    with pytest.raises(ConfigError) as refused:
        settings({"enable-ssrf-protection": "true", "inference-pool-namespace": "ns"}, {})
    assert str(refused.value) == (
        "invalid enable-ssrf-protection (--enable-ssrf-protection) = True: needs --inference-pool or "
        "INFERENCE_POOL (--inference-pool-name or INFERENCE_POOL_NAME missing)"
    )


def test_the_older_per_stage_tls_switches() -> None:
    given = {"prefiller-use-tls": "true", "decoder-use-tls": "1", "decoder-tls-insecure-skip-verify": "t"}
    expected = {"decode_url": "https://localhost:8200", "prefill_tls": True}
    assert settings(given, {}) == {**expected, "prefill_tls_insecure": False, "decode_tls_insecure": True}
    assert settings({"prefiller-use-tls": "false", "prefiller-tls-insecure-skip-verify": "false"}, {}) == {}
    assert settings({"prefiller-tls-insecure-skip-verify": "true", "enable-tls": "decoder"}, {}) == {
        "decode_url": "https://localhost:8200",
        "prefill_tls_insecure": True,
        "decode_tls_insecure": False,
    }


def test_tracing_notes_say_why_it_is_off_or_how_it_differs() -> None:
    notes: list[str] = []
    assert settings({"tracing": "true"}, {"OTEL_TRACES_EXPORTER": "console"}, notes) == {}
    assert notes == [
        "--tracing: llm-d's console exporter (OTEL_TRACES_EXPORTER unset or not otlp) is not offered: "
        "spans on stdout would mix with the logs; tracing is off (set OTEL_TRACES_EXPORTER=otlp)"
    ]
    notes.clear()
    grpc = {**OTLP, "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4317/"}
    assert settings({"tracing": "true"}, grpc, notes) == {
        "otlp_traces_endpoint": "http://c:4317/",
        "trace_sample_ratio": 0.1,
    }
    assert notes == [
        "--tracing: spans go by OTLP over HTTP (port 4318), not gRPC (4317) as llm-d's: "
        "point OTEL_EXPORTER_OTLP_TRACES_ENDPOINT at the collector's OTLP/HTTP port"
    ]
    notes.clear()
    env = {
        "OTEL_TRACES_EXPORTER": " OTLP ",
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318",
        "OTEL_TRACES_SAMPLER": "always_on",
        "OTEL_TRACES_SAMPLER_ARG": "0.5",
    }
    assert settings({"tracing": "true"}, env, notes) == {
        "otlp_traces_endpoint": "http://c:4318",
        "trace_sample_ratio": 0.1,
    }
    assert notes == []
