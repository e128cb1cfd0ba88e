"""Config loading: precedence flags > env > file > defaults, and errors that name field, value, reason."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys

import pytest

from sidecar.config import Config, ConfigError, build_parser, dump, env_names, load, unknown_env


def parse(*argv: str) -> argparse.Namespace:
    return build_parser(argparse.ArgumentParser()).parse_args(list(argv))


def test_defaults() -> None:
    config = load(parse(), {})
    assert config == Config()
    assert (config.decode_url, config.host, config.port, config.admin_port) == (
        "http://127.0.0.1:8200",
        "0.0.0.0",
        8000,
        9100,
    )
    assert config.release == "dry-run"


def test_precedence_flags_over_env_over_file() -> None:
    text = 'port = 7000\nadmin_port = 7100\nrelease = "off"\nrelease_workers = 2\n'
    env = {"KVR_PORT": "7001", "KVR_ADMIN_PORT": "7101"}
    config = load(parse("--port", "7002"), env, text)
    assert config.port == 7002  # flag
    assert config.admin_port == 7101  # env over file
    assert config.release == "off"  # file over default
    assert config.release_workers == 2


def test_env_lists_and_bools() -> None:
    config = load(
        parse(), {"KVR_PREFILL_ALLOW": "10.0.0.0/8, *.prefill.svc:5600", "KVR_RELEASE_AMBIGUOUS": "true"}
    )
    assert config.prefill_allow == ("10.0.0.0/8", "*.prefill.svc:5600")
    assert config.release_ambiguous is True


def test_bool_flag() -> None:
    assert load(parse("--release-ambiguous"), {}).release_ambiguous is True
    assert load(parse("--no-release-ambiguous"), {"KVR_RELEASE_AMBIGUOUS": "1"}).release_ambiguous is False


@pytest.mark.parametrize(
    ("flags", "env", "field", "value"),
    [
        (("--port", "70000"), {}, "port", 70000),
        ((), {"KVR_PORT": "eighty"}, "port", "eighty"),
        (("--decode-url", "ftp://x"), {}, "decode_url", "ftp://x"),
        (("--decode-url", "localhost:8200"), {}, "decode_url", "localhost:8200"),
        (("--connect-timeout", "0"), {}, "connect_timeout", 0.0),
        (("--max-body-bytes", "-5"), {}, "max_body_bytes", -5),
        ((), {"KVR_RELEASE": "teleport"}, "release", "teleport"),
        (("--admin-port", "8000"), {}, "admin_port", 8000),
        (("--vllm-version", "latest"), {}, "vllm_version", "latest"),
        (("--prefill-allow", "not a host!"), {}, "prefill_allow", "not a host!"),
        (("--prefill-allow", "10.0.0.0/8:99999"), {}, "prefill_allow", "10.0.0.0/8:99999"),
        (("--read-timeout", "-1"), {}, "read_timeout", -1.0),
    ],
)
def test_errors_name_field_value_reason(
    flags: tuple[str, ...], env: dict[str, str], field: str, value: object
) -> None:
    with pytest.raises(ConfigError) as info:
        load(parse(*flags), env)
    assert info.value.field == field
    assert info.value.value == value
    assert info.value.reason
    assert field in str(info.value) and repr(value) in str(info.value)


def test_unknown_file_key_and_bad_toml() -> None:
    with pytest.raises(ConfigError, match=r"^sidecar\.toml: unknown key 'colour'$"):
        load(parse(), {}, "colour = 'blue'\n", "sidecar.toml")
    closest = r"^sidecar\.toml: unknown key 'relase' \(did you mean 'release'\?\)$"
    with pytest.raises(ConfigError, match=closest):
        load(parse(), {}, "relase = 'nixl'\n", "sidecar.toml")
    with pytest.raises(ConfigError, match=r"^sidecar\.toml: not valid TOML: .*line 1"):
        load(parse(), {}, "port = = 1\n", "sidecar.toml")


@pytest.mark.parametrize(
    ("flags", "env", "text", "source"),
    [
        (("--port", "x"), {"KVR_PORT": "1"}, "port = 2", "--port"),
        ((), {"KVR_PORT": "x"}, "port = 2", "KVR_PORT"),
        ((), {}, 'port = "x"', "sidecar.toml, key port"),
        ((), {}, "port = 8000\nadmin_port = 8000", "sidecar.toml, key admin_port"),
        ((), {"KVR_ADMIN_PORT": "8000"}, "", "KVR_ADMIN_PORT"),  # checked after merging: still named
    ],
)
def test_errors_name_the_source_of_the_value(
    flags: tuple[str, ...], env: dict[str, str], text: str, source: str
) -> None:
    with pytest.raises(ConfigError) as info:
        load(parse(*flags), env, text, "sidecar.toml")
    assert info.value.source == source
    assert f"({source})" in str(info.value)


def test_choices_and_types_read_as_plain_text() -> None:
    with pytest.raises(ConfigError) as info:
        load(parse(), {"KVR_RELEASE": "teleport"})
    assert info.value.reason == "must be one of off, dry-run, nixl, http, auto"
    with pytest.raises(ConfigError) as info:
        load(parse(), {"KVR_RELEASE_WORKERS": "many"})
    assert info.value.reason == "expected int" and "`" not in str(info.value)


def test_unknown_kvr_variables_are_named_with_the_closest_setting() -> None:
    environ = {"KVR_RELASE": "nixl", "KVR_PORT": "1", "KVR_CONFIG": "x", "KVR_ZZZZZZ": "1", "HOME": "/"}
    assert unknown_env(environ) == [
        "KVR_RELASE is not a setting and is ignored (did you mean 'KVR_RELEASE'?)",
        "KVR_ZZZZZZ is not a setting and is ignored",
    ]


@pytest.mark.parametrize(
    ("field", "url", "reason"),
    [
        ("decode_url", "http://127.0.0.1:99999", "port '99999' is not a TCP port"),
        ("decode_url", "http://127.0.0.1:0", "port 0 is not a TCP port"),
        ("decode_url", "http://d:8200/v1", "without a path (got '/v1')"),
        ("decode_url", "http://d:8200?x=1", "without a path (got '?x=1')"),
        ("prefill", "http://p:8100/v1", "without a path"),
        ("control_url", "http://d:99999/kv_release/v1/release", "port '99999'"),
        ("otlp_traces_endpoint", "http://c:70000", "port '70000'"),
        ("decode_url", "http://::1:8200", "an IPv6 address needs brackets: http://[::1]:8200"),
        ("decode_url", "https://fe80::1", "an IPv6 address needs brackets: https://[fe80::1]"),
        ("prefill", "http://fd00::7:8100", "needs brackets: http://[fd00::7]:8100"),
    ],
)
def test_urls_are_checked_for_port_and_path(field: str, url: str, reason: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(reason)) as info:
        load({field: url}, {})
    assert info.value.field == field


@pytest.mark.parametrize(
    ("field", "url"),
    [
        ("decode_url", "http://d:8200/"),  # a trailing slash is no path
        ("decode_url", "https://[::1]:8443"),
        ("control_url", "http://d:8200/kv_release/v1/release"),  # a full endpoint URL keeps its path
        ("otlp_traces_endpoint", "http://c:4318/v1/traces"),
    ],
)
def test_urls_that_are_fine(field: str, url: str) -> None:
    assert getattr(load({field: url}, {}), field) == url


def test_config_is_frozen() -> None:
    config = Config()
    with pytest.raises(AttributeError):
        config.port = 1  # type: ignore[misc]


def test_one_env_variable_per_flag() -> None:
    flags = {a.dest for a in build_parser(argparse.ArgumentParser())._actions if a.dest not in ("help",)}
    flags.discard("config")
    assert {f"KVR_{f.upper()}" for f in flags} == set(env_names())


def test_bad_value_exits_2_before_any_socket() -> None:
    # --port 1 would need root to bind; exit code 2 proves validation ran first.
    result = subprocess.run(
        [sys.executable, "-m", "sidecar", "serve", "--decode-url", "nope", "--port", "1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "decode_url" in result.stderr and "'nope'" in result.stderr


def test_dump_redacts_credentials() -> None:
    # The start-up log line carries dump(config): a trust key or control token in it would hand
    # anyone who reads logs the power to sign releases or call D's control endpoint.
    config = load(
        {"trust": "hmac", "otlp_traces_endpoint": "https://user:pw@collector:4318/v1/traces"},
        {"KVR_TRUST_KEY": "supersecretkey123", "KVR_CONTROL_TOKEN": "ctl-token-9", "KVR_TRUST_TOKEN": "tt-7"},
    )
    dumped = dump(config)
    text = repr(dumped)
    for secret in ("supersecretkey123", "ctl-token-9", "tt-7", "user:pw"):
        assert secret not in text
    assert dumped["trust_key"] == dumped["control_token"] == dumped["trust_token"] == "<redacted>"
    assert dumped["otlp_traces_endpoint"] == "https://<redacted>@collector:4318/v1/traces"
    assert dumped["trust"] == "hmac"  # the rest is as configured
    assert dump(load({}, {}))["trust_key"] == ""  # an empty one stays visibly empty


def test_an_error_about_a_secret_does_not_echo_it() -> None:
    error = ConfigError("trust_key", "supersecretkey123", "too short")
    assert "supersecretkey123" not in str(error) and "trust_key" in str(error)
    assert "<redacted>" in str(error)


@pytest.mark.parametrize("release", ["off", "dry-run"])
def test_dry_run_needs_a_strategy_that_would_send(release: str) -> None:
    with pytest.raises(ConfigError, match="needs --release nixl, http or auto") as info:
        load(parse("--dry-run", "--release", release), {})
    assert info.value.field == "dry_run"


@pytest.mark.parametrize("release", ["nixl", "http", "auto"])
def test_dry_run_of_a_live_strategy_is_one_flag_or_variable(release: str) -> None:
    assert load(parse("--dry-run", "--release", release), {}).dry_run
    assert load(parse("--release", release), {"KVR_DRY_RUN": "1"}).dry_run


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("30", 30.0),
        ("30s", 30.0),
        ("1.5s", 1.5),
        ("500ms", 0.5),
        ("2m", 120.0),
        ("1h", 3600.0),
        (" 5 S ", 5.0),
    ],
)
def test_durations_take_a_unit(text: str, seconds: float) -> None:
    assert load({"release_deadline": text}, {}).release_deadline == seconds
    assert load({}, {"KVR_DRAIN_TIMEOUT": text}).drain_timeout == seconds
    assert load({}, {}, f'handshake_timeout = "{text}"').handshake_timeout == seconds


@pytest.mark.parametrize("text", ["30x", "abc", "s", "1 s s"])
def test_a_duration_that_does_not_parse_says_seconds(text: str) -> None:
    with pytest.raises(ConfigError, match="must be a number of seconds, or a duration such as 30s") as info:
        load({}, {}, f'release_deadline = "{text}"', "sidecar.toml")
    assert "sidecar.toml, key release_deadline" in str(info.value)
    with pytest.raises(ConfigError, match="must be a number of seconds"):
        load({}, {}, "release_deadline = true")


def test_the_port_moved_onto_the_other_is_the_one_blamed() -> None:
    with pytest.raises(ConfigError) as proxy:
        load(parse("--port", "9100"), {})
    assert proxy.value.field == "port" and "--port" in str(proxy.value)
    with pytest.raises(ConfigError) as admin:
        load(parse("--admin-port", "8000"), {})
    assert admin.value.field == "admin_port" and "--admin-port" in str(admin.value)
