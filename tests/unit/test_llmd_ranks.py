"""The rank a listener gives a request: ``x-data-parallel-host-port`` matched as llm-d matches it.

llm-d's rank 0 server keys its ranks by ``net.JoinHostPort(POD_IP, port)`` and
looks the header's value up as text, on the routes it intercepts; other
listeners and routes ignore the header. The front is called as uvicorn calls
it, with a recording app behind it.
"""

from __future__ import annotations

from typing import Any

import pytest

from sidecar.app.ranks import RANK, RankFront, host_port, rank_url
from sidecar.config import Config
from sidecar.llmd.command import load

PORT = 8000


async def front_answer(config: Config, listener: int, request: dict[str, Any]) -> int | str:
    """The rank the app is given for ``request`` on ``listener``, or the front's own status."""
    seen: list[int] = []
    sent: list[dict[str, Any]] = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        seen.append(scope[RANK])

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    headers = [(n.encode(), v.encode()) for n, v in request.get("headers", {}).items()]
    scope = {
        "type": "http",
        "method": request.get("method", "POST"),
        "path": request["path"],
        "headers": headers,
    }
    await RankFront(app, listener, config)(scope, None, send)
    if seen:
        return seen[0]
    assert sent[1]["body"] == b""
    return f"status {sent[0]['status']}"


def dp2(pod_ip: str = "10.0.0.7", answers: str = "llm-d") -> Config:
    return Config(port=PORT, data_parallel_size=2, pod_ip=pod_ip, answers=answers)  # type: ignore[arg-type]


def named(value: str, path: str = "/v1/completions", method: str = "POST") -> dict[str, Any]:
    return {"path": path, "method": method, "headers": {"x-data-parallel-host-port": value}}


@pytest.mark.parametrize(
    ("config", "listener", "request_", "expected"),
    [
        (dp2(), 0, {"path": "/v1/completions"}, 0),
        (dp2(), 0, named("10.0.0.7:8001"), 1),
        (dp2(), 0, named("10.0.0.7:8000"), 0),
        (dp2(), 0, named("10.0.0.8:8001"), "status 400"),  # another pod's address
        (dp2(), 0, named("10.0.0.7:8002"), "status 400"),  # no rank listens there
        (dp2(), 0, named("localhost:8001"), "status 400"),  # text, not resolved: as llm-d
        (dp2(), 0, named(""), 0),  # empty is absent (Go's Header.Get)
        (dp2(""), 0, named(":8001"), 1),  # no POD_IP: JoinHostPort("", port)
        (dp2(""), 0, named("10.0.0.7:8001"), "status 400"),
        (dp2("fd00::7"), 0, named("[fd00::7]:8001"), 1),
        (dp2("fd00::7"), 0, named("fd00::7:8001"), "status 400"),
        (dp2(), 0, named("10.0.0.7:8001", "/v1/messages"), 1),  # llm-d intercepts it
        (dp2(), 0, named("10.0.0.7:8001", "/inference/v1/generate"), 1),
        (dp2(), 0, named("bogus", "/v1/models", "GET"), 0),  # not an intercepted route
        (dp2(), 0, named("bogus", "/v1/completions", "GET"), 0),
        (dp2(), 0, named("bogus", "/tokenize"), 0),
        (dp2(), 1, named("10.0.0.7:8000"), 1),  # rank 1's listener ignores the header
        (dp2(), 1, named("bogus"), 1),
        (Config(port=PORT, pod_ip="10.0.0.7", answers="llm-d"), 0, named("10.0.0.7:8000"), 0),
        (Config(port=PORT, pod_ip="10.0.0.7", answers="llm-d"), 0, named("10.0.0.7:8001"), "status 400"),
        (dp2(answers="vllm"), 0, named("10.0.0.7:8001"), 1),  # ranks without llm-d's answers
        (Config(port=PORT, pod_ip="10.0.0.7"), 0, named("bogus"), 0),  # serve, one rank: no table
    ],
)
async def test_the_header_picks_a_rank_as_llm_d_s_rank_0_server_does(
    config: Config, listener: int, request_: dict[str, Any], expected: int | str
) -> None:
    assert await front_answer(config, listener, request_) == expected


async def test_health_is_answered_by_the_front_only_with_llm_d_s_answers() -> None:
    assert await front_answer(dp2(), 1, {"path": "/health", "method": "GET"}) == "status 200"
    assert await front_answer(dp2(), 0, {"path": "/health", "method": "HEAD"}) == "status 200"
    assert await front_answer(dp2(), 0, {"path": "/health", "method": "POST"}) == 0
    assert await front_answer(dp2(answers="vllm"), 1, {"path": "/health", "method": "GET"}) == 1


def test_go_s_join_host_port_and_rank_urls() -> None:
    assert host_port("", 8000) == ":8000" and host_port("fd00::1", 8001) == "[fd00::1]:8001"
    assert rank_url("https://localhost:8200", 2) == "https://localhost:8202"
    assert rank_url("http://[::1]:8200", 1) == "http://[::1]:8201"


def test_pod_ip_is_read_from_llm_d_s_variable() -> None:
    assert load([], {"POD_IP": " 10.0.0.7 "})[0].pod_ip == "10.0.0.7"
    assert load([], {})[0].pod_ip == ""
