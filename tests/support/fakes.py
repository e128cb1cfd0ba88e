"""Fakes at the proxy's seams, for unit tests: the upstream client, D as the judge reads it, a
recording releaser; for tests that drive a protocol by hand: its transport, and a loop
counting timers; ``ProbedD``, D's endpoints as ``sidecar.decode`` probes them; and ``release_params``,
a release's parameters made from a plain dict.

``FakeUpstream`` speaks ``sidecar.upstream.Client``, as httpx's ``MockTransport``
speaks a transport: every request goes to a handler that returns a
``FakeResponse`` or raises ``UpstreamError``. Nothing opens a socket, so the
proxy's request path (``sidecar.proxy``) and the router (``sidecar.router``)
run as plain ASGI calls with a scripted receive and a recording send.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from types import SimpleNamespace, TracebackType
from typing import Any

import msgspec

from sidecar.classify import NoAnswer
from sidecar.decode.state import DecodeState
from sidecar.params import ReleaseParams, check
from sidecar.server.limits import ServerLimits
from sidecar.server.protocol import GuardedProtocol, guarded_protocol
from sidecar.upstream import Sent, UpstreamError


@dataclass
class FakeRequest:
    """One request the proxy sent upstream."""

    method: str
    target: str
    headers: list[tuple[str, str]]
    body: bytes | None

    def header(self, name: str) -> str | None:
        return next((v for n, v in self.headers if n == name), None)

    def json(self) -> Any:
        assert self.body is not None
        return msgspec.json.decode(self.body)


@dataclass
class FakeResponse:
    """A response: status, headers, and the body in chunks (``broken`` raises after them)."""

    status: int = 200
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    body: list[bytes] = field(default_factory=list)
    broken: bool = False
    closed: bool = False
    taken: int = 0  # body chunks already read (``read`` takes them; ``chunks`` yields the rest)

    @classmethod
    def json(cls, status: int, payload: Any) -> FakeResponse:
        data = msgspec.json.encode(payload)
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
        return cls(status, headers, [data])

    @classmethod
    def sse(cls, *events: Any, broken: bool = False) -> FakeResponse:
        chunks = [b"data: " + msgspec.json.encode(e) + b"\n\n" for e in events]
        if not broken:
            chunks.append(b"data: [DONE]\n\n")
        return cls(200, [(b"content-type", b"text/event-stream")], chunks, broken=broken)

    async def chunks(self) -> AsyncIterator[bytes]:
        while self.taken < len(self.body):
            await asyncio.sleep(0)
            self.taken += 1
            yield self.body[self.taken - 1]
        if self.broken:
            raise UpstreamError(NoAnswer.RESET_AFTER_SEND, "D broke the stream")

    @property
    def ended(self) -> bool:
        """As ``UpstreamResponse.ended``: every chunk taken, and the body ends cleanly."""
        return self.taken >= len(self.body) and not self.broken

    async def read(self, limit: int) -> bytes:
        """As ``UpstreamResponse.read``: whole chunks until ``limit`` bytes or more were taken."""
        parts: list[bytes] = []
        size = 0
        while size < limit and self.taken < len(self.body):
            parts.append(self.body[self.taken])
            size += len(parts[-1])
            self.taken += 1
        return b"".join(parts)

    async def __aenter__(self) -> FakeResponse:
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.closed = True


Handler = Callable[[FakeRequest], Awaitable[FakeResponse] | FakeResponse]


class FakeUpstream:
    """``sidecar.upstream.Client`` answered by ``handler``; records every request."""

    def __init__(self, handler: Handler, base_url: str = "http://d.test:8200", reached: bool = True) -> None:
        self.handler = handler
        self.base_url = base_url
        self.reached = reached  # whether a failure the handler raises came after the request was sent
        self.requests: list[FakeRequest] = []

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None

    async def send(
        self,
        method: str,
        target: str,
        headers: list[tuple[str, str]],
        body: bytes | AsyncIterator[bytes] | None,
        header_timeout: float | None = None,
        sent: Sent | None = None,
    ) -> FakeResponse:
        if body is not None and not isinstance(body, bytes):
            body = b"".join([chunk async for chunk in body])
        request = FakeRequest(method, target, list(headers), body)
        self.requests.append(request)
        if sent is not None:
            sent.may_have_reached_d = self.reached
        answer = self.handler(request)
        if not isinstance(answer, FakeResponse):
            answer = await answer
        return answer


def refused(request: FakeRequest) -> FakeResponse:
    """D is down: nothing listens."""
    raise UpstreamError(NoAnswer.CONNECT_REFUSED, "connection refused")


class FakeDecode:
    """``DecodeWatch``: D's release and whether its engine can notify, set by the test."""

    def __init__(self, version: str | None = "0.34.0", can_notify: bool = True) -> None:
        self._version, self._can_notify = version, can_notify
        self.observed: list[tuple[NoAnswer | int, str | None, bool]] = []  # what the proxy saw of D

    def version(self) -> str | None:
        return self._version

    def can_notify(self) -> bool:
        return self._can_notify

    def observe(self, signal: NoAnswer | int, message: str | None = None, *, closing: bool = False) -> None:
        self.observed.append((signal, message, closing))


@dataclass
class Client:
    """A scripted ASGI client: one request in, the messages the app sent out."""

    method: str = "POST"
    path: str = "/v1/completions"
    body: bytes = b""
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    disconnect_after_body: bool = False
    sent: list[dict[str, Any]] = field(default_factory=list)

    def scope(self) -> dict[str, Any]:
        return {
            "type": "http",
            "method": self.method,
            "path": self.path,
            "raw_path": self.path.encode(),
            "query_string": b"",
            "headers": [(b"content-length", str(len(self.body)).encode()), *self.headers],
        }

    async def receive(self) -> dict[str, Any]:
        if self.body is not None:
            body, self.body = self.body, None  # type: ignore[assignment]
            return {"type": "http.request", "body": body, "more_body": False}
        if not self.disconnect_after_body:
            await asyncio.Event().wait()  # the client stays until the test ends
        return {"type": "http.disconnect"}

    async def send(self, message: dict[str, Any]) -> None:
        self.sent.append(message)

    @property
    def status(self) -> int:
        return int(next(m["status"] for m in self.sent if m["type"] == "http.response.start"))

    @property
    def response_headers(self) -> dict[bytes, bytes]:
        start = next(m for m in self.sent if m["type"] == "http.response.start")
        return dict(start["headers"])

    @property
    def response_body(self) -> bytes:
        return b"".join(m.get("body", b"") for m in self.sent if m["type"] == "http.response.body")


class CountingLoop:
    """The running loop, counting ``call_later`` and ``call_at``; everything else passes through."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.timers = 0

    def call_later(self, delay: float, callback: Any, *args: Any) -> asyncio.TimerHandle:
        self.timers += 1
        return self._loop.call_later(delay, callback, *args)

    def call_at(self, when: float, callback: Any, *args: Any) -> asyncio.TimerHandle:
        self.timers += 1
        return self._loop.call_at(when, callback, *args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loop, name)


class FakeTransport:
    """The transport calls the server protocol makes, recorded."""

    def __init__(self) -> None:
        self.written = bytearray()
        self.writes: list[bytes] = []  # one entry per write call: what a socket write would send
        self.closing = False
        self.closed = asyncio.Event()
        self.reading = True
        self.protocol: Any = None

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"sockname": ("127.0.0.1", 8000), "peername": ("127.0.0.1", 50000)}.get(name, default)

    def get_protocol(self) -> Any:
        return self.protocol

    def write(self, data: bytes) -> None:
        self.written += data
        self.writes.append(bytes(data))

    def writelines(self, data: list[bytes]) -> None:
        self.write(b"".join(data))

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        self.closing = True
        self.closed.set()

    def abort(self) -> None:
        self.closing = True

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True


@dataclass
class ServerState:
    """What a server shares with its connections (uvicorn's ``Server.server_state``)."""

    connections: set[Any] = field(default_factory=set)
    tasks: set[asyncio.Task[None]] = field(default_factory=set)
    total_requests: int = 0


def guarded_connection(
    app: Any, limits: ServerLimits | None = None, state: ServerState | None = None, loop: Any = None
) -> tuple[GuardedProtocol, FakeTransport]:
    """One client connection to the sidecar's server protocol (``GuardedProtocol`` under
    ``limits``) answered by the ASGI ``app``, on a ``FakeTransport``; the server's state is
    ``state``, or a new one; ``loop`` the running loop unless given."""
    config = SimpleNamespace(loaded_app=app)
    protocol = guarded_protocol(limits or ServerLimits())(config, state or ServerState(), {}, loop=loop)
    transport = FakeTransport()
    transport.protocol = protocol
    protocol.connection_made(transport)  # type: ignore[arg-type]
    return protocol, transport


def release_params(fields: dict[str, object]) -> ReleaseParams:
    """``ReleaseParams`` from a decoded ``kv_transfer_params`` object, checked as the proxy checks
    a request's (``sidecar.params.check``); ValueError if not eligible."""
    found = check(msgspec.json.encode(fields))
    if found.params is None:
        raise ValueError(f"kv_transfer_params not releasable: {found.reason} {found.detail}".strip())
    return found.params


# D as its probes read it (``sidecar.decode``): a vLLM 0.33.0 D, alive, with a NIXL connector.
NIXL_METRICS = (
    b'# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{model_name="m"} 0.0\n'
    b"# TYPE vllm:nixl_xfer_time_seconds histogram\n"
    b'vllm:nixl_xfer_time_seconds_count{engine="0",model_name="m"} 0.0\n'
)
V033 = (200, [], b'{"version":"0.33.0"}')
OK = (200, [], b"")
Answer = tuple[int, list[tuple[bytes, bytes]], bytes]  # status, headers, body


class ProbedD(FakeUpstream):
    """D's ``/health``, ``/version`` and ``/metrics`` as ``FakeUpstream`` answers them, by path.

    An answer is (status, headers, body), bytes (a 200), an exception to raise, or an async callable
    giving one; ``set`` changes them. ``calls`` lists the paths asked, in order; a body comes in
    chunks of ``chunk`` bytes.
    """

    def __init__(self, **answers: Any) -> None:
        super().__init__(self._answer)
        self.answers: dict[str, Any] = {"health": OK, "version": V033, "metrics": NIXL_METRICS, **answers}
        self.chunk = 1 << 20

    @property
    def calls(self) -> list[str]:
        return [request.target.strip("/") for request in self.requests]

    def set(self, **answers: Any) -> None:
        self.answers.update(answers)

    async def _answer(self, request: FakeRequest) -> FakeResponse:
        answer = self.answers[request.target.strip("/")]
        if callable(answer):
            answer = await answer()
        if isinstance(answer, BaseException):
            raise answer
        if isinstance(answer, bytes):
            answer = (200, [], answer)
        status, headers, body = answer
        chunks = [body[start : start + self.chunk] for start in range(0, len(body), self.chunk)]
        return FakeResponse(status, list(headers), chunks)


def connect_refused() -> UpstreamError:
    """What the client raises when nothing listens at D."""
    return UpstreamError(NoAnswer.CONNECT_REFUSED, "cannot connect to D")


def probed_state(upstream: FakeUpstream, **kwargs: Any) -> DecodeState:
    """``DecodeState`` over ``upstream``, its poller slow unless ``interval`` is given."""
    return DecodeState(upstream, interval=kwargs.pop("interval", 3600.0), **kwargs)  # type: ignore[arg-type]
