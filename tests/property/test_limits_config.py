"""The server-limit settings: nonsense stops start-up naming the field, sense reaches the servers."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sidecar.config import MIN_HEADER_BYTES, Config, ConfigError, load
from sidecar.server.host import server_options
from sidecar.server.limits import ServerLimits

TIMEOUTS = ("timeout_keep_alive", "client_header_timeout", "client_body_timeout")


@given(st.sampled_from(TIMEOUTS), st.floats(max_value=0.0, allow_nan=False))
def test_a_timeout_must_be_positive(field: str, value: float) -> None:
    with pytest.raises(ConfigError) as info:
        Config(**{field: value})
    assert (info.value.field, info.value.value) == (field, value)


@given(st.integers(max_value=-1))
def test_limit_concurrency_must_not_be_negative(value: int) -> None:
    with pytest.raises(ConfigError) as info:
        Config(limit_concurrency=value)
    assert info.value.field == "limit_concurrency"


@given(st.integers(max_value=MIN_HEADER_BYTES - 1))
def test_max_header_bytes_must_fit_a_request(value: int) -> None:
    with pytest.raises(ConfigError) as info:
        Config(max_header_bytes=value)
    assert info.value.field == "max_header_bytes" and str(MIN_HEADER_BYTES) in info.value.reason


@given(
    st.integers(min_value=0, max_value=10**6),
    st.integers(min_value=MIN_HEADER_BYTES, max_value=10**7),
    st.floats(min_value=0.001, max_value=1e6),
)
def test_valid_limits_reach_both_servers(concurrency: int, header_bytes: int, seconds: float) -> None:
    config = Config(
        limit_concurrency=concurrency,
        max_header_bytes=header_bytes,
        client_header_timeout=seconds,
        client_body_timeout=seconds * 2,
        timeout_keep_alive=seconds * 3,
    )
    proxy, admin = ServerLimits.of(config), ServerLimits.of(config, admin=True)
    assert proxy == ServerLimits(header_bytes, seconds, seconds * 2, concurrency, seconds * 3)
    assert admin == ServerLimits(header_bytes, seconds, seconds * 2, 0, seconds * 3)  # probes always answer
    options = server_options(proxy)
    assert options["http"].limits == proxy  # type: ignore[attr-defined]


def test_limits_load_from_flags_env_and_file() -> None:
    text = "max_header_bytes = 8192\nclient_body_timeout = 30.0\n"
    env = {"KVR_LIMIT_CONCURRENCY": "64", "KVR_CLIENT_HEADER_TIMEOUT": "5"}
    config = load({"timeout_keep_alive": "75"}, env, text)
    assert (config.limit_concurrency, config.client_header_timeout, config.timeout_keep_alive) == (
        64,
        5.0,
        75.0,
    )
    assert (config.max_header_bytes, config.client_body_timeout) == (8192, 30.0)
    defaults = Config()
    assert (defaults.limit_concurrency, defaults.max_header_bytes) == (0, 64 * 1024)
    assert (defaults.client_header_timeout, defaults.client_body_timeout, defaults.timeout_keep_alive) == (
        10.0,
        60.0,
        5.0,
    )
