"""llm-d's command line onto the config: one row per flag, each checked, and the docs table.

``ROWS`` holds, for every flag of ``sidecar.llmd.table`` (pd-sidecar's own and the
few accepted beyond them), a command line and the settings it must produce; a
flag without a row, or a row whose mapping breaks, fails here. The table in
docs/llm-d.md must list exactly pd-sidecar's flags with the tag each appeared in.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import httpx
import pytest

from sidecar.checks import Context
from sidecar.checks.settings import check_trust
from sidecar.config import ConfigError
from sidecar.llmd.command import load, recognises
from sidecar.llmd.flags import duration
from sidecar.llmd.table import EXTRA, FLAGS, KV_CONNECTORS, MAPPING, NEWEST_TAG

DOC = Path(__file__).resolve().parents[2] / "docs" / "llm-d.md"
BASE = load([], {})[0]
OFF_MORIIO = {"release": "off", "releases_off_for": "moriio", "prefill_leg": "nixlv2"}
POOL = ["--enable-ssrf-protection"]
ALPHA = "inference.networking.x-k8s.io"

# flag -> (argv, the settings it must set); {} means: accepted, and nothing differs from no flags.
ROWS: dict[str, tuple[list[str], dict[str, Any]]] = {
    "port": (["--port=8100"], {"port": 8100}),
    "model-server-port": (["--model-server-port", "9001"], {"decode_url": "http://localhost:9001"}),
    "vllm-port": (["--vllm-port=9000"], {"decode_url": "http://localhost:9000"}),
    "data-parallel-size": (["--data-parallel-size=2"], {"data_parallel_size": 2}),
    "kv-connector": (["--kv-connector=mooncake"], {"release": "off", "prefill_leg": "skip"}),
    "connector": (["--connector=shared-storage"], {"release": "off", "releases_off_for": "kv_connector"}),
    "ec-connector": (["--ec-connector=nixl"], {"release": "off", "releases_off_for": "ec_connector"}),
    "secure-proxy": (["--secure-proxy=false"], {"tls": False}),
    "cert-path": (["--cert-path=/etc/certs"], {"tls_cert_dir": "/etc/certs"}),
    "enable-tls": (["--enable-tls=prefiller"], {"prefill_tls": True, "decode_url": BASE.decode_url}),
    "tls-insecure-skip-verify": (
        ["--tls-insecure-skip-verify=prefiller"],
        {"prefill_tls_insecure": True, "decode_tls_insecure": False},
    ),
    "prefiller-use-tls": (["--prefiller-use-tls=true"], {"prefill_tls": True}),
    "decoder-use-tls": (["--decoder-use-tls", "--vllm-port=8001"], {"decode_url": "https://localhost:8001"}),
    "prefiller-tls-insecure-skip-verify": (
        ["--prefiller-tls-insecure-skip-verify=true"],
        {"prefill_tls_insecure": True},
    ),
    "decoder-tls-insecure-skip-verify": (
        ["--decoder-tls-insecure-skip-verify"],
        {"decode_tls_insecure": True},
    ),
    "enable-ssrf-protection": ([*POOL, "--inference-pool=ns/p"], {"inference_pool": "ns/p"}),
    "inference-pool": ([*POOL, "--inference-pool=pool"], {"inference_pool": "default/pool"}),
    "inference-pool-namespace": (
        [*POOL, "--inference-pool-namespace=ns", "--inference-pool-name=p"],
        {"inference_pool": "ns/p"},
    ),
    "inference-pool-name": (
        [*POOL, "--inference-pool-name=p", "--inference-pool-namespace", "team"],
        {"inference_pool": "team/p"},
    ),
    "pool-group": (["--pool-group=inference.networking.x-k8s.io"], {"pool_group": ALPHA}),
    "max-idle-conns-per-host": (["--max-idle-conns-per-host=64"], {"pool_size": 64}),
    "prefill-max-retries": (["--prefill-max-retries=3"], {"prefill_max_retries": 3}),
    "prefill-retry-backoff": (["--prefill-retry-backoff=1m30s"], {"prefill_retry_backoff": 90.0}),
    "decode-chunk-size": (["--decode-chunk-size=0"], {}),
    "enable-prefiller-sampling": (["--enable-prefiller-sampling"], {"prefill_policy": "random"}),
    "enable-p2p-pull": (["--enable-p2p-pull=false"], {}),
    "mooncake-bootstrap-port": (["--mooncake-bootstrap-port=9999"], {}),
    "p2p-connector-port": (["--p2p-connector-port=7000"], {}),
    "tracing": (["--tracing"], {}),  # without OTEL_TRACES_EXPORTER=otlp: off (see the tracing tests)
    "metrics-port": (["--metrics-port=9400"], {"admin_port": 9400}),
    "configuration": (
        ["--configuration={port: 8300, max-idle-conns-per-host: 8}"],
        {"port": 8300, "pool_size": 8},
    ),
    "configuration-file": (["--configuration-file=FILE"], {"port": 8400}),
    "zap-log-level": (["--zap-log-level=4"], {"log_level": "debug"}),
    "zap-encoder": (["--zap-encoder=console"], {"log_format": "text"}),
    "zap-devel": (["--zap-devel"], {"log_level": "debug", "log_format": "text"}),
    "zap-stacktrace-level": (["--zap-stacktrace-level=panic"], {}),
    "zap-time-encoding": (["--zap-time-encoding=iso8601"], {}),
    "kubeconfig": (["--kubeconfig=/root/.kube/config"], {}),
    "moriio-write-mode": (["--moriio-write-mode"], {**OFF_MORIIO, "prefill_leg": "skip"}),
    "moriio-decode-notify-port": (["--moriio-decode-notify-port=61005"], OFF_MORIIO),
    "moriio-local-pod-ip": (["--moriio-local-pod-ip=10.0.0.9"], OFF_MORIIO),
    "moriio-decode-handshake-port": (["--moriio-decode-handshake-port=6301"], OFF_MORIIO),
    "moriio-parallel-dispatch": (["--moriio-parallel-dispatch=false"], OFF_MORIIO),
    "moriio-parallel-decode-wait-timeout": (["--moriio-parallel-decode-wait-timeout=30s"], OFF_MORIIO),
    "moriio-prefill-handshake-port": (["--moriio-prefill-handshake-port=6301"], OFF_MORIIO),
    "moriio-prefill-notify-port": (["--moriio-prefill-notify-port=61005"], OFF_MORIIO),
    "moriio-tp-size": (["--moriio-tp-size=2"], OFF_MORIIO),
    "moriio-dp-size": (["--moriio-dp-size=8"], OFF_MORIIO),
    "moriio-remote-hosts": (["--moriio-remote-hosts=10.0.0.1,10.0.0.2"], OFF_MORIIO),
    "moriio-dp-size-local": (["--moriio-dp-size-local=4"], OFF_MORIIO),
    "moriio-decode-hosts": (["--moriio-decode-hosts=10.0.0.3"], OFF_MORIIO),
    "secure-serving": (["--secure-serving=false"], {"tls": False}),
    "tls-min-version": (["--tls-min-version=VersionTLS13"], {"tls_min_version": "1.3"}),
    "tls-cipher-suites": (
        ["--tls-cipher-suites=TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256"],
        {"tls_ciphers": ("TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256",)},
    ),
    "metrics-cert-dir": (["--metrics-cert-dir=/etc/m"], {"admin_tls_cert_dir": "/etc/m"}),
}


def test_every_flag_has_a_row() -> None:
    assert set(ROWS) == set(FLAGS), set(FLAGS) ^ set(ROWS)


@pytest.mark.parametrize("flag", sorted(ROWS))
def test_each_flag_maps_onto_the_config(flag: str, tmp_path: Path) -> None:
    argv, expected = ROWS[flag]
    (tmp_path / "sidecar.yaml").write_text("port: 8400\n")
    argv = [a.replace("FILE", str(tmp_path / "sidecar.yaml")) for a in argv]
    config, _ = load(argv, {})
    for field, value in expected.items():
        assert getattr(config, field) == value, field
    differs = [f for f in BASE.__struct_fields__ if getattr(config, f) != getattr(BASE, f)]
    assert not [f for f in differs if f not in expected and f not in _ALSO.get(flag, ())], differs


# Fields a row's flag also changes besides those it names (derived, checked in their own tests).
_ALSO: dict[str, tuple[str, ...]] = {
    "kv-connector": ("releases_off_for",),
    "connector": ("prefill_leg",),
    "ec-connector": (),
}


def test_a_connector_this_sidecar_cannot_release_for_keeps_the_pod_serving() -> None:
    for connector in KV_CONNECTORS:
        notes: list[str] = []
        config, _ = load([f"--kv-connector={connector}"], {}, notes)
        if connector == "nixlv2":
            assert (config.release, config.prefill_leg, notes) == ("nixl", "nixlv2", [])
            continue
        assert config.release == "off" and config.releases_off_for == "kv_connector"
        assert config.prefill_leg == ("refuse" if connector == "sglang" else "skip")
        assert len(notes) == 1 and connector in notes[0] and "releases are off" in notes[0]
    with pytest.raises(ConfigError, match="--kv-connector"):
        load(["--kv-connector=dynamo"], {})


def test_kv_connector_wins_over_the_older_connector_flag() -> None:
    config, _ = load(["--connector=sglang", "--kv-connector=nixlv2"], {})
    assert config.release == "nixl"


@pytest.mark.parametrize(
    ("level", "expected"),
    [
        *[("0", "info"), ("1", "info"), ("2", "info"), ("3", "info"), ("4", "debug"), ("5", "debug")],
        *[("debug", "debug"), ("info", "info"), ("error", "error"), ("panic", "error")],
    ],
)
def test_zap_log_level_numbers_are_verbosities(level: str, expected: str) -> None:
    assert load([f"--zap-log-level={level}"], {})[0].log_level == expected


def test_environment_variables_llm_d_reads() -> None:
    env = {"INFERENCE_POOL_NAMESPACE": "ns", "INFERENCE_POOL_NAME": "p", "ENABLE_PREFILLER_SAMPLING": "true"}
    config, _ = load(POOL, env)
    assert config.inference_pool == "ns/p" and config.prefill_policy == "random"
    assert load(POOL, {**env, "INFERENCE_POOL": "other/q"})[0].inference_pool == "other/q"
    assert load([*POOL, "--inference-pool-name=flag"], env)[0].inference_pool == "ns/flag"
    assert load(["--enable-prefiller-sampling=false"], env)[0].prefill_policy == "first"
    with pytest.raises(ConfigError, match="INFERENCE_POOL_NAME"):
        load(POOL, {"INFERENCE_POOL_NAMESPACE": "ns"})


OTLP = {"OTEL_TRACES_EXPORTER": "otlp"}


def test_tracing_as_llm_d_sets_it_up() -> None:
    notes: list[str] = []
    config, _ = load(["--tracing"], {**OTLP, "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, notes)
    assert (config.otlp_traces_endpoint, config.trace_sample_ratio) == ("http://collector:4318", 0.1)
    assert notes == []
    env = {**OTLP, "OTEL_TRACES_SAMPLER_ARG": "0.5", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://t:4318"}
    config, _ = load(["--tracing"], env)
    assert (config.otlp_traces_endpoint, config.trace_sample_ratio) == ("http://t:4318", 0.5)
    config, _ = load(["--tracing"], {**env, "OTEL_TRACES_SAMPLER": "always_on"})
    assert config.trace_sample_ratio == 0.1  # llm-d falls back to its ratio sampler at 0.1


def test_tracing_that_cannot_run_is_off_and_said(monkeypatch: pytest.MonkeyPatch) -> None:
    notes: list[str] = []
    config, _ = load(["--tracing"], {}, notes)  # llm-d's console exporter
    assert config.otlp_traces_endpoint == "" and "console" in notes[0]
    notes.clear()
    config, _ = load(["--tracing"], {**OTLP, "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317"}, notes)
    assert config.otlp_traces_endpoint == "http://c:4317" and "gRPC" in notes[0]
    monkeypatch.setattr("sidecar.extras.missing_module", lambda extra: "opentelemetry.sdk")
    notes.clear()
    config, _ = load(["--tracing"], OTLP, notes)
    assert config.otlp_traces_endpoint == "" and "otel extra" in notes[0]


def test_the_guides_args_serve_with_llm_d_s_inbound_timeouts() -> None:
    notes: list[str] = []
    argv = ["--port=8000", "--kv-connector=nixlv2", "--zap-log-level=1", "--secure-proxy=false"]
    config, _ = load(argv, {}, notes)
    assert (config.port, config.tls, config.log_level, config.release) == (8000, False, "info", "nixl")
    assert config.prefill_allow_default == "routable" and not config.prefill_allow and not notes
    assert (config.timeout_keep_alive, config.client_header_timeout) == (300.0, 30.0)


def test_a_clients_own_parameters_are_never_released_by_default_allowlist_or_not() -> None:
    """As llm-d's sidecar: only the parameters P returned to the router's own leg are released."""
    for env in ({}, {"KVR_PREFILL_ALLOW": "10.0.0.0/8"}):
        config, _ = load(["--port=8000", "--kv-connector=nixlv2"], env)
        assert config.release_client_params is False
    config, _ = load([], {"KVR_PREFILL_ALLOW": "10.0.0.0/8", "KVR_RELEASE_CLIENT_PARAMS": "true"})
    assert config.release_client_params is True  # a setup that needs them says so


def test_kserve_s_args_with_and_without_tls() -> None:
    env = {"INFERENCE_POOL_NAMESPACE": "ns", "INFERENCE_POOL_NAME": "svc-inference-pool"}
    common = ["/app/pd-sidecar", "--port=8000", "--vllm-port=8001", "--kv-connector=nixlv2"]
    common += ["--enable-ssrf-protection=true", "--pool-group=inference.networking.x-k8s.io"]
    tls = ["--secure-proxy=true", "--cert-path=/var/run/kserve/tls", "--decoder-use-tls=true"]
    config, _ = load([*common, *tls, "--prefiller-use-tls=true"], env)
    assert (config.decode_url, config.prefill_tls, config.tls) == ("https://localhost:8001", True, True)
    assert (config.inference_pool, config.pool_group) == ("ns/svc-inference-pool", ALPHA)
    config, _ = load([*common, "--secure-proxy=false", "", "", ""], env)  # the template's empty args
    assert (config.decode_url, config.prefill_tls, config.tls) == ("http://localhost:8001", False, False)


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--decode-chunk-size=64"], "decode-chunk-size"),
        (["--enable-p2p-pull"], "enable-p2p-pull"),
        (["--enable-ssrf-protection"], "enable-ssrf-protection"),
        (["--tls-min-version=VersionTLS11"], "tls-min-version"),
        (["--enable-tls=encoders"], "enable-tls"),
        (["--pool-group=example.com"], "pool_group"),
        (["--enable-speculative-prefill"], "enable-speculative-prefill"),
    ],
)
def test_what_cannot_be_honoured_is_refused_in_one_line(argv: list[str], named: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load(argv, {})
    assert named in str(caught.value) and "\n" not in str(caught.value)


def test_kvr_variables_change_the_drop_in_s_defaults_but_not_llm_d_flags() -> None:
    config, _ = load(["--port=8100"], {"KVR_RELEASE": "dry-run", "KVR_PORT": "9999"})
    assert config.release == "dry-run" and config.port == 8100
    config, _ = load([], {"KVR_TIMEOUT_KEEP_ALIVE": "5", "KVR_PREFILL_ALLOW_DEFAULT": "none"})
    assert (config.timeout_keep_alive, config.prefill_allow_default) == (5.0, "none")


def test_serve_recognises_llm_d_flags_only() -> None:
    assert recognises(["--port=8000", "--vllm-port=8200"]) and not recognises(
        ["--port=8000", "--config", "x"]
    )
    assert recognises(["--moriio-tp-size=2"]) and recognises(["--connector=nixlv2"])


def test_go_durations() -> None:
    assert duration("f", "200ms") == pytest.approx(0.2) and duration("f", "1h") == 3600
    with pytest.raises(ConfigError):
        duration("f", "2 seconds")


ROW = re.compile(r"^\| ((?:`--[a-z0-9-]+`(?:, )?)+) \| (v[0-9.]+) \|", re.M)


def test_the_docs_table_names_pd_sidecar_s_flags_with_their_tag() -> None:
    text = DOC.read_text()
    tagged = {f: tag for flags, tag in ROW.findall(text) for f in re.findall(r"--([a-z0-9-]+)", flags)}
    assert set(tagged) == set(MAPPING), set(tagged) ^ set(MAPPING)
    assert {f: MAPPING[f].since for f in tagged} == tagged
    mentioned = set(re.findall(r"`--([a-z0-9-]+)`", text))
    assert set(EXTRA) <= mentioned and not set(EXTRA) & set(tagged)


def test_llm_d_s_inbound_timeouts_reach_every_rank_s_server() -> None:
    """Idle keep-alive 300 s and a 30 s header deadline (llm-d's http.Server) on each listener;
    ``serve`` keeps vLLM's 5 s and 10 s (tests/integration/test_hostile_input.py closes an idle
    connection on a real socket with a short value)."""
    from sidecar.app.core import ProxyApp
    from sidecar.config import Config
    from sidecar.server.serve import _rank_server

    config, _ = load(["--port=8000", "--data-parallel-size=2", "--secure-proxy=false"], {})
    for rank in (0, 1):
        server = _rank_server(ProxyApp(config), config, rank, None)
        protocol = server.config.http
        limits = protocol.limits  # type: ignore[union-attr]
        assert (limits.keep_alive, limits.header_timeout) == (300.0, 30.0)
    assert (Config().timeout_keep_alive, Config().client_header_timeout) == (5.0, 10.0)


def test_serve_s_own_flags_that_llm_d_shares_keep_serve_s_meaning() -> None:
    assert not recognises(["--data-parallel-size=2", "--pool-group", "inference.networking.k8s.io"])
    assert not recognises(["--prefill-max-retries=1", "--tls-min-version", "1.3", "--inference-pool=a/b"])
    assert recognises(["--data-parallel-size=2", "--model-server-port=8200"])


def _tag(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.removeprefix("v").split("."))


def test_the_newest_tag_named_is_the_newest_in_the_table() -> None:
    assert max((flag.since for flag in MAPPING.values()), key=_tag) == NEWEST_TAG


@pytest.mark.parametrize(
    ("argv", "flag", "hint"),
    [
        (["--port=8000", "--new-knob=5s"], "new-knob", ""),
        (["--vllm-prt", "8001"], "vllm-prt", " (did you mean 'vllm-port'?)"),
    ],
)
def test_an_unknown_flag_stops_the_start_naming_it_and_the_newest_tag_known(
    argv: list[str], flag: str, hint: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        load(argv, {})
    assert caught.value.field == flag and caught.value.source == f"--{flag}"
    assert f"unknown flag{hint}: not a flag of llm-d's pd-sidecar up to {NEWEST_TAG}," in str(caught.value)


async def test_check_says_a_clients_own_parameters_are_never_released() -> None:
    config, sources = load(["--port=8000", "--kv-connector=nixlv2"], {"KVR_PREFILL_ALLOW": "10.0.0.0/8"})
    async with httpx.AsyncClient() as client:
        [finding] = await check_trust(Context(config, sources, client))
    assert finding.status == "ok" and "never released" in finding.detail
