"""Tracing settings and start-up checks (sidecar.config, sidecar.observability.tracing)."""

from __future__ import annotations

import sys

import pytest

from sidecar import cli
from sidecar.config import Config, ConfigError, load
from sidecar.observability import tracing

OTEL_MODULES = ("opentelemetry.sdk.trace", "opentelemetry.exporter.otlp.proto.http.trace_exporter")


def test_defaults_leave_tracing_off() -> None:
    config = Config()
    assert (config.otlp_traces_endpoint, config.trace_sample_ratio) == ("", 1.0)
    assert config.trace_service_name == "kv-release-sidecar"
    assert tracing.build(config) is tracing.OFF and not tracing.OFF.enabled


def test_settings_come_from_flags_env_and_toml() -> None:
    config = load(
        {"trace_service_name": "kvr-decode-0"},
        {"KVR_OTLP_TRACES_ENDPOINT": "http://otel-collector:4318", "KVR_TRACE_SAMPLE_RATIO": "0.1"},
        'trace_sample_ratio = 0.5\ntrace_service_name = "from-file"\n',
    )
    assert config.otlp_traces_endpoint == "http://otel-collector:4318"
    assert config.trace_sample_ratio == 0.1 and config.trace_service_name == "kvr-decode-0"


@pytest.mark.parametrize("ratio", ["-0.1", "1.5", "nan", "lots"])
def test_a_bad_sample_ratio_names_the_field(ratio: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load({}, {"KVR_TRACE_SAMPLE_RATIO": ratio})
    assert caught.value.field == "trace_sample_ratio"
    assert "(KVR_TRACE_SAMPLE_RATIO)" in str(caught.value)  # the variable the value came from


@pytest.mark.parametrize("endpoint", ["otel-collector:4318", "grpc://otel-collector:4317", "http://"])
def test_a_bad_endpoint_names_the_field(endpoint: str) -> None:
    with pytest.raises(ConfigError) as caught:
        Config(otlp_traces_endpoint=endpoint)
    assert caught.value.field == "otlp_traces_endpoint"


def test_an_empty_service_name_is_refused() -> None:
    with pytest.raises(ConfigError) as caught:
        Config(trace_service_name=" ")
    assert caught.value.field == "trace_service_name"


@pytest.mark.parametrize(
    ("endpoint", "url"),
    [
        ("http://c:4318", "http://c:4318/v1/traces"),
        ("http://c:4318/", "http://c:4318/v1/traces"),
        ("https://c/otlp/v1/traces", "https://c/otlp/v1/traces"),
    ],
)
def test_a_bare_endpoint_gets_the_traces_path(endpoint: str, url: str) -> None:
    assert tracing.traces_url(endpoint) == url


@pytest.mark.parametrize("module", OTEL_MODULES)
def test_missing_packages_fail_start_up_with_exit_2(
    module: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, module, None)  # `import module` now raises ImportError
    code = cli.main(["serve", "--otlp-traces-endpoint", "http://127.0.0.1:4318", "--port", "0"])
    assert code == 2
    error = capsys.readouterr().err
    assert "otlp_traces_endpoint" in error and "--otlp-traces-endpoint" in error
    assert "tracing needs the otel extra, which is not installed" in error
    assert 'pip install "<checkout>[otel]"' in error and error.count("\n") == 1


def test_missing_packages_also_stop_the_app_from_building_tracing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "opentelemetry.sdk.trace", None)
    with pytest.raises(ConfigError, match=r"needs the otel extra"):
        tracing.build(Config(otlp_traces_endpoint="http://127.0.0.1:4318"))


def test_without_an_endpoint_the_packages_are_not_needed(monkeypatch: pytest.MonkeyPatch) -> None:
    for module in OTEL_MODULES:
        monkeypatch.setitem(sys.modules, module, None)
    tracing.require(Config())
    assert tracing.build(Config()) is tracing.OFF


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("http://d:8200/v1/completions", "http://d:8200/v1/completions"),
        ("http://user:secret@d:8200/v1/completions", "http://REDACTED:REDACTED@d:8200/v1/completions"),
        (
            "https://tok@[::1]/v1/chat/completions?x=1",
            "https://REDACTED:REDACTED@[::1]/v1/chat/completions?x=1",
        ),
    ],
)
def test_url_full_never_carries_credentials(url: str, shown: str) -> None:
    from urllib.parse import urlsplit

    from sidecar.observability.otel import _redacted

    assert _redacted(urlsplit(url)) == shown
