"""llm-d's answers on the serving port: when ``/health`` is the sidecar's, D refusing connections.

The sidecar runs in process behind the serving port's front (``RankFront``, as
``serve`` runs it) on loopback, with D's port closed (connections refused) or a
real sim-decode. ``answers = "llm-d"`` is what llm-d's command line gives
(``pd-sidecar``, or ``serve`` given llm-d's flags) unless ``answers`` is set.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry

from sidecar import cli
from sidecar.app import Deps, create_admin_app, create_app
from sidecar.app.ranks import RankFront
from sidecar.config import Config
from sidecar.llmd.command import load
from sidecar.proxy.answers import DECODE_NOT_READY, FORBIDDEN
from sidecar.release.stub import StubReleaser as DryRunReleaser
from sidecar.server import serve as serve_mod
from sidecar.sim.decode import create_decode_app
from sidecar.sim.decode.config import DecodeSimConfig
from sidecar.sim.servers import serve
from tests.support.ports import free_port

# llm-d's decode deployment's routing-sidecar args (docs/llm-d.md), TLS off to keep this short.
LLM_D_ARGS = ["--port=0", "--vllm-port=8200", "--kv-connector=nixlv2", "--secure-proxy=false"]
SNIFFED = "text/plain; charset=utf-8"


@contextmanager
def front(decode_url: str, answers: str) -> Iterator[str]:
    """The sidecar's serving port as ``serve`` runs it; yields its URL."""
    config = Config(decode_url=decode_url, release="dry-run", answers=answers, log_level="warning")  # type: ignore[arg-type]
    app = create_app(config, Deps(releaser=DryRunReleaser(keep=10), registry=CollectorRegistry()))
    with serve(RankFront(app, 0, config), create_admin_app(app)) as server:
        yield server.url


def test_d_refusing_connections_is_llm_d_s_503_sent_as_go_sends_it() -> None:
    refused = f"http://127.0.0.1:{free_port()}"
    with front(refused, "llm-d") as url:
        for answer in (
            httpx.post(url + "/v1/completions", json={"model": "m", "prompt": "hi"}),
            httpx.get(url + "/v1/models"),
        ):
            assert answer.status_code == 503
            assert answer.content == DECODE_NOT_READY
            assert answer.headers["content-type"] == SNIFFED  # Go sniffed the JSON as text
            assert "x-content-type-options" not in answer.headers
    with front(refused, "vllm") as url:
        answer = httpx.get(url + "/v1/models")
        assert answer.status_code == 503 and answer.headers["content-type"] == "application/json"
        assert answer.json()["error"]["code"] == 503


@pytest.mark.parametrize("method", ["GET", "HEAD"])
def test_health_is_the_sidecar_s_with_llm_d_s_answers_and_d_s_otherwise(method: str) -> None:
    refused = f"http://127.0.0.1:{free_port()}"
    with front(refused, "llm-d") as url:
        mine = httpx.request(method, url + "/health")
        assert (mine.status_code, mine.content, mine.headers["content-length"]) == (200, b"", "0")
        assert httpx.post(url + "/health").status_code == 503  # not llm-d's route: D's (refused)
        assert httpx.request(method, url + "/health/").status_code == 503
    with front(refused, "vllm") as url:
        assert httpx.request(method, url + "/health").status_code == 503  # D's: refused
    with serve(create_decode_app(DecodeSimConfig(port=0, model="m"))) as d, front(d.url, "vllm") as url:
        assert httpx.request(method, url + "/health").status_code == 200  # D's own answer


def captured_start(monkeypatch: pytest.MonkeyPatch) -> list[Config]:
    """``serve.start`` replaced: the config each command would serve, without serving it."""
    seen: list[Config] = []

    def start(config: Config, sources: dict[str, str]) -> int:
        seen.append(config)
        return 0

    monkeypatch.setattr(serve_mod, "start", start)
    for name in [n for n in os.environ if n.startswith("KVR_")]:
        monkeypatch.delenv(name)
    return seen


@pytest.mark.parametrize(
    ("argv", "environ", "answers"),
    [
        (["pd-sidecar", *LLM_D_ARGS], {}, "llm-d"),
        (["serve", *LLM_D_ARGS], {}, "llm-d"),  # the image's entry point given llm-d's args
        (["pd-sidecar"], {}, "llm-d"),  # no flag at all: llm-d's defaults
        (["serve", *LLM_D_ARGS], {"KVR_ANSWERS": "vllm"}, "vllm"),  # set on purpose
        (["serve", "--port", "0"], {}, "vllm"),  # serve's own flags: vLLM's answers
    ],
)
def test_llm_d_s_command_line_gives_llm_d_s_answers(
    argv: list[str], environ: dict[str, str], answers: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen = captured_start(monkeypatch)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    assert cli.main(argv) == 0
    assert [c.answers for c in seen] == [answers]


def test_llm_d_s_defaults_as_a_whole() -> None:
    config: Any = load([], {})[0]
    assert (config.answers, config.tls, config.release, config.port) == ("llm-d", True, "nixl", 8000)
    assert config.decode_url == "http://localhost:8200" and config.prefill_policy == "first"


def test_llm_d_s_header_is_refused_not_ignored_without_an_allowlist(caplog: pytest.LogCaptureFixture) -> None:
    body = {"model": "m", "prompt": "hi", "max_tokens": 2}
    named = {"x-prefiller-host-port": "10.1.2.3:8000"}
    with serve(create_decode_app(DecodeSimConfig(port=0, model="m"))) as d:
        with caplog.at_level(logging.WARNING, logger="sidecar.router"), front(d.url, "llm-d") as url:
            refused = httpx.post(url + "/v1/completions", json=body, headers=named)
            assert (refused.status_code, refused.text) == (403, FORBIDDEN.decode())
            assert httpx.get(d.url + "/sim/log").json() == []  # D never saw it: no silent decode-only
        assert any("no prefill allowlist" in r.getMessage() for r in caplog.records)
        with front(d.url, "vllm") as url:  # serve's sidecar mode: the header is another router's
            assert httpx.post(url + "/v1/completions", json=body, headers=named).status_code == 200
