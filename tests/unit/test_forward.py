"""``Forwarder`` driven directly with an ``Exchange``: when the response starts, and when D's head
is judged.

Every path that answers the client (D's 200 pumped, its JSON corrected in router mode, its error
answer, the sidecar's own answer when D fails) sends its head through the exchange's
``responding`` wrapper, so the exchange says it responded before the head leaves; and D's
head is judged as it arrives, so D's state learns of a ``Connection: close`` before the client
sees the head, also for a stream whose first event decides later.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from sidecar.classify import Cause, NoAnswer
from sidecar.observability.tracing import Tracing
from sidecar.proxy import handler
from sidecar.proxy.context import Exchange, RequestContext
from sidecar.proxy.handler import Forwarder
from sidecar.proxy.usage import UsageRewriter
from sidecar.upstream import UpstreamError
from tests.support.fakes import Client, FakeDecode, FakeRequest, FakeResponse, FakeUpstream, refused
from tests.unit.exchanges import Rig, exchange

CLOSE = (b"connection", b"close")
TOKEN = {"choices": [{"text": "hi"}], "usage": {"prompt_tokens_details": {"cached_tokens": 0}}}


class BrokenBody(FakeResponse):
    """D's head arrived, then D broke off before the body was whole."""

    async def read(self, limit: int) -> bytes:
        raise UpstreamError(NoAnswer.RESET_AFTER_SEND, "D broke off its body")


class Stalled(FakeResponse):
    """D's head arrived; its first body byte never does."""

    async def chunks(self) -> AsyncIterator[bytes]:
        await asyncio.Event().wait()
        yield b""


class Run:
    """One exchange forwarded to a fake D: what the client got, and at each head that left,
    whether the exchange said it responded and what D's state had been told."""

    def __init__(self, made: Exchange) -> None:
        self.made, self.decode, self.client = made, FakeDecode(None), Client(body=b"")
        self.rig = Rig(decode=self.decode)
        self.heads: list[tuple[bool, list[tuple[NoAnswer | int, str | None, bool]]]] = []
        self.started = asyncio.Event()

    async def send(self, message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            self.heads.append((self.made.responded, list(self.decode.observed)))
            self.started.set()
        await self.client.send(message)

    async def forward(self, answer: Callable[[FakeRequest], FakeResponse], leaves: bool = False) -> None:
        async def receive() -> dict[str, Any]:
            if leaves:  # the client leaves once the head reached it
                await self.started.wait()
                return {"type": "http.disconnect"}
            await asyncio.Event().wait()
            raise AssertionError("unreachable")

        forwarder = Forwarder(FakeUpstream(answer), self.rig.judge, self.rig.metrics, Tracing())  # type: ignore[arg-type]
        ctx = RequestContext.of(self.client.scope(), receive, self.send)
        await forwarder.forward(ctx, self.made, [], b"{}")


def _json(status: int, payload: Any, *extra: tuple[bytes, bytes]) -> FakeResponse:
    answer = FakeResponse.json(status, payload)
    answer.headers.extend(extra)
    return answer


def _broken(status: int) -> BrokenBody:
    return BrokenBody(status, [(b"content-type", b"application/json")], [b"{"])


def _router() -> Exchange:
    return exchange(rewriter=UsageRewriter(7, stream=False))


ERROR = {"error": {"message": "no", "type": "BadRequestError", "param": None, "code": 400}}
PATHS: list[tuple[str, Callable[[], Exchange], Callable[[FakeRequest], FakeResponse], int]] = [
    ("stream", lambda: exchange(stream=True), lambda r: FakeResponse.sse(TOKEN), 200),
    (
        "stream-without-params",
        lambda: exchange(stream=True, params=None),
        lambda r: FakeResponse.sse(TOKEN),
        200,
    ),
    ("json", exchange, lambda r: _json(200, TOKEN), 200),
    ("error", exchange, lambda r: _json(400, ERROR), 400),
    ("error-broken-off", exchange, lambda r: _broken(400), 400),
    ("d-unreachable", exchange, refused, 503),
    ("router-json", _router, lambda r: _json(200, TOKEN), 200),
    ("router-json-broken-off", _router, lambda r: _broken(200), 502),
    ("router-json-over-the-limit", _router, lambda r: _json(200, TOKEN), 200),
]


@pytest.mark.parametrize(("make", "answer", "status"), [p[1:] for p in PATHS], ids=[p[0] for p in PATHS])
async def test_every_answer_marks_the_exchange_responded_before_its_head_goes_out(
    make: Callable[[], Exchange],
    answer: Callable[[FakeRequest], FakeResponse],
    status: int,
    monkeypatch: pytest.MonkeyPatch,
    request: pytest.FixtureRequest,
) -> None:
    if request.node.callspec.id == "router-json-over-the-limit":
        monkeypatch.setattr(handler, "REWRITE_LIMIT", 8)  # passed on as it came, not held
    run = Run(make())
    await run.forward(answer)
    assert run.client.status == status
    assert [responded for responded, _ in run.heads] == [True]  # one head, the exchange marked first
    assert run.made.responded


@pytest.mark.parametrize(
    ("make", "answer"),
    [
        (
            lambda: exchange(stream=True),
            lambda r: FakeResponse(200, [(b"content-type", b"text/event-stream"), CLOSE], [b"data: {}\n\n"]),
        ),
        (exchange, lambda r: _json(200, TOKEN, CLOSE)),
        (_router, lambda r: _json(200, TOKEN, CLOSE)),
    ],
    ids=["stream", "json", "router-json"],
)
async def test_ds_connection_close_reaches_its_state_before_the_head_goes_out(
    make: Callable[[], Exchange], answer: Callable[[FakeRequest], FakeResponse]
) -> None:
    """D closing its connection is news of D (before vLLM 0.28, uvicorn's SIGTERM): D's state
    hears it when D's head arrives, once, whether the stream's first event decides later or not."""
    run = Run(make())
    await run.forward(answer)
    assert run.heads == [(True, [(200, None, True)])]
    assert run.decode.observed == [(200, None, True)]  # the first event, no error, tells nothing more
    assert run.made.judged is not None and run.made.judged.decision.cause is Cause.ADMITTED


async def test_a_client_leaving_a_closing_stream_before_its_first_event() -> None:
    """The head went out, so D has the request (judged as an admitted 200 stream, not a request D
    may never have had); D's closing was heard when its head arrived."""
    run = Run(exchange(stream=True))
    await run.forward(lambda r: Stalled(200, [(b"content-type", b"text/event-stream"), CLOSE]), leaves=True)
    assert run.heads == [(True, [(200, None, True)])]
    assert run.decode.observed == [(200, None, True)]
    assert run.made.judged is not None and run.made.judged.decision.cause is Cause.ADMITTED
    assert run.rig.queue.jobs == []
