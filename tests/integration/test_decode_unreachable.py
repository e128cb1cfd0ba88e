"""A D the sidecar cannot reach says why, once, at start-up; a TLS mismatch is named as one.

Without this, a wrong port, https against a plain-http D or an IPv6/IPv4
mismatch left the log ending at "Application startup complete" and only
``/readyz`` said ``decode: false``. The failure that keeps a request from D is
classified too: a failed TLS handshake is ``tls_failed`` (nothing was sent:
released like an unreachable D), never "refused, start D".
"""

from __future__ import annotations

import logging

import httpx
import pytest

from sidecar.sim.decode import create_decode_app
from sidecar.sim.decode.config import DecodeSimConfig
from sidecar.sim.servers import serve
from tests.support.ports import free_port
from tests.support.runner import kv_params, run_sidecar

LOGGER = "sidecar.decode_state"


def _start_up_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and "at start-up" in r.getMessage()]


def test_a_port_nothing_listens_on_is_one_warning_with_the_likely_causes(
    caplog: pytest.LogCaptureFixture,
) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    with caplog.at_level(logging.WARNING, logger=LOGGER), run_sidecar(url) as sc:
        assert httpx.get(sc.admin_url + "/readyz").status_code == 503
    [warning] = _start_up_warnings(caplog)
    assert f"nothing accepts connections at {url}: D not started yet, a wrong port" in warning
    assert "::1" in warning  # the address-family mismatch is named


def test_https_against_a_plain_http_d_is_a_tls_failure(caplog: pytest.LogCaptureFixture) -> None:
    config = DecodeSimConfig(port=0)
    with serve(create_decode_app(config)) as d, caplog.at_level(logging.WARNING, logger=LOGGER):
        url = d.url.replace("http://", "https://")
        with run_sidecar(url) as sc:
            body = {"model": config.model, "prompt": "hi", "kv_transfer_params": kv_params("r-tls")}
            answer = httpx.post(sc.url + "/v1/completions", json=body)
            assert answer.status_code == 503 and "TLS handshake with D failed" in answer.text
            assert sc.wait_released(1) == ["r-tls"]  # nothing reached D: released as unreachable
            assert sc.sample("kvr_rejections_total", cause="unreachable") == 1
    [warning] = _start_up_warnings(caplog)
    assert f"the TLS handshake with {url} failed: D serves plain http? (use http:// in decode_url)" in warning


def test_a_d_that_answers_logs_no_warning(caplog: pytest.LogCaptureFixture) -> None:
    with (
        serve(create_decode_app(DecodeSimConfig(port=0))) as d,
        caplog.at_level(logging.WARNING, logger=LOGGER),
        run_sidecar(d.url) as sc,
    ):
        assert httpx.get(sc.admin_url + "/readyz").status_code == 200
    assert _start_up_warnings(caplog) == []
