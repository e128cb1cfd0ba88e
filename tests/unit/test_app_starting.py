"""While the InferencePool is first listed, the proxy app answers 503 in the configured answers' shape."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from sidecar.app.core import NOT_STARTED, ProxyApp
from sidecar.config import Config


class Waiting:
    """Stands for the runtime while its ``starting`` task is pending or done."""

    def __init__(self, starting: asyncio.Future[None]) -> None:
        self.starting = starting
        self.proxied: list[str] = []
        self.ranks: list[Any] = []

    async def proxy(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        self.proxied.append(scope["path"])


async def call(app: ProxyApp, headers: list[tuple[bytes, bytes]]) -> list[dict[str, Any]]:
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    async def receive() -> dict[str, Any]:
        raise AssertionError("the body is not read while starting")

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": headers}
    await app(scope, receive, send)
    return sent


@pytest.mark.parametrize("answers", ["vllm", "llm-d"])
async def test_a_request_while_the_pool_is_first_listed_gets_503_then_the_proxy(answers: str) -> None:
    app = ProxyApp(Config(answers=answers))  # type: ignore[arg-type]
    starting: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    runtime = Waiting(starting)
    app.runtime = runtime  # type: ignore[assignment]
    start, body = await call(app, [(b"x-request-id", b"r-1")])
    headers = dict(start["headers"])
    assert start["status"] == 503 and headers[b"x-request-id"] == b"r-1"
    answer = json.loads(body["body"])
    if answers == "vllm":
        assert headers[b"content-type"] == b"application/json"
        assert answer["error"]["type"] == "ServiceUnavailableError" and answer["error"]["code"] == 503
        assert answer["error"]["message"] == NOT_STARTED
    else:  # llm-d's flat shape, untyped as Go sends it (sniffed as text)
        assert headers[b"content-type"] == b"text/plain; charset=utf-8"
        assert answer == {
            "object": "error",
            "message": NOT_STARTED,
            "type": "ServiceUnavailable",
            "param": "",
            "code": 503,
        }
    assert runtime.proxied == []
    starting.set_result(None)  # listed (or the wait ended): the proxy serves
    await call(app, [])
    assert runtime.proxied == ["/v1/completions"]
