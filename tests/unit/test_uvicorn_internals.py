"""The uvicorn internals ``sidecar.server.protocol`` (and ``sidecar.server.serve``'s server) are built on.

``GuardedProtocol`` subclasses uvicorn's httptools protocol: it overrides
some of its methods, calls others, reads and sets attributes of the protocol,
of its request/response cycle and of its flow control, and replaces the
keep-alive timer uvicorn starts in ``on_response_complete``. None of that is
uvicorn's public API, which is why ``pyproject.toml`` pins uvicorn below its
next minor release. When that pin is raised, these tests say what moved:
each names an internal the sidecar uses and checks that it is still there,
of the same kind, with the same parameters, doing what the sidecar expects.
"""

from __future__ import annotations

import asyncio
import collections
import inspect
from collections.abc import Callable
from typing import Any

import pytest
import uvicorn
from uvicorn.protocols.http import flow_control, httptools_impl
from uvicorn.server import ServerState

from sidecar.server.cycle import UvicornCycle
from sidecar.server.limits import ServerLimits
from sidecar.server.protocol import guarded_protocol
from sidecar.transport.relay import ClientRelay
from tests.fakes import FakeTransport

Protocol = httptools_impl.HttpToolsProtocol
REQUEST = b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\n{}"

# Methods GuardedProtocol overrides (calling uvicorn's own through super()) or calls, by their
# parameters after self.
PROTOCOL_METHODS = {
    "__init__": ["config", "server_state", "app_state", "_loop"],
    "connection_made": ["transport"],
    "connection_lost": ["exc"],
    "data_received": ["data"],
    "on_message_begin": [],
    "on_headers_complete": [],
    "on_body": ["body"],
    "on_message_complete": [],
    "on_response_complete": [],  # replaced, not extended, when no pipelined request waits
    "send_400_response": ["msg"],
    "_unset_keepalive_if_required": [],
    "pause_writing": [],  # extended: a relayed body's back-pressure (sidecar.transport.relay)
    "resume_writing": [],
}
FLOW_CONTROL_METHODS = {"__init__": ["transport"], "pause_reading": [], "resume_reading": []}
SERVER_METHODS = {"startup": ["sockets"], "capture_signals": [], "serve": ["sockets"]}


def _parameters(method: Callable[..., Any]) -> list[str]:
    return list(inspect.signature(method).parameters)[1:]


@pytest.mark.parametrize(
    ("owner", "methods"),
    [
        (Protocol, PROTOCOL_METHODS),
        (flow_control.FlowControl, FLOW_CONTROL_METHODS),
        (uvicorn.Server, SERVER_METHODS),
    ],
    ids=["HttpToolsProtocol", "FlowControl", "Server"],
)
def test_the_methods_the_sidecar_overrides_or_calls_keep_their_parameters(
    owner: type, methods: dict[str, list[str]]
) -> None:
    for name, parameters in methods.items():
        method = owner.__dict__.get(name)
        assert inspect.isfunction(method), f"{owner.__name__}.{name} is no longer a plain method"
        assert _parameters(method) == parameters, f"{owner.__name__}.{name}{inspect.signature(method)}"
    if owner is uvicorn.Server:
        # serve's server replaces capture_signals (serve handles the signals), which uvicorn's
        # serve enters as a context manager, and awaits startup (which exits on a failed lifespan)
        assert inspect.iscoroutinefunction(owner.startup) and inspect.iscoroutinefunction(owner.serve)
        assert "with self.capture_signals():" in inspect.getsource(owner.serve)
        assert "sys.exit(" in inspect.getsource(owner.startup)


def test_the_asgi_type_names_limits_imports_exist() -> None:
    from uvicorn import _types

    for name in ("ASGI3Application", "ASGIReceiveCallable", "ASGISendCallable", "Scope"):
        assert hasattr(_types, name), f"uvicorn._types.{name}"


async def _answer(scope: Any, receive: Any, send: Any) -> None:
    await receive()
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


async def test_the_protocol_and_cycle_attributes_the_sidecar_reads_and_sets() -> None:
    config = uvicorn.Config(app=_answer, lifespan="off", log_level="critical")
    state = ServerState()
    protocol = guarded_protocol(ServerLimits())(config, state, {}, asyncio.get_running_loop())
    transport = FakeTransport()
    transport.protocol = protocol
    protocol.connection_made(transport)  # type: ignore[arg-type]
    # set by uvicorn's __init__ or connection_made
    assert protocol.loop is asyncio.get_running_loop() and protocol.tasks is state.tasks
    assert protocol.app is config.loaded_app
    assert isinstance(protocol.pipeline, collections.deque) and not protocol.pipeline
    assert protocol.server_state is state and protocol.timeout_keep_alive_task is None
    assert isinstance(protocol.flow, flow_control.FlowControl) and protocol.flow.read_paused is False
    protocol.data_received(REQUEST)
    # on_message_begin / on_url / on_header / on_headers_complete: the request head and its cycle
    assert protocol.url == b"/v1/chat/completions"
    assert protocol.headers == [(b"host", b"x"), (b"content-length", b"2")]
    cycle = protocol.cycle
    assert isinstance(cycle, httptools_impl.RequestResponseCycle) and len(protocol.tasks) == 1
    # the cycle writes through the protocol's transport, which is how a head is held for its body
    assert cycle.transport is protocol.transport and cycle.flow is protocol.flow
    assert cycle.on_response == protocol.on_response_complete  # GuardedProtocol's, per request
    assert isinstance(cycle.message_event, asyncio.Event)
    assert (cycle.response_started, cycle.response_complete, cycle.disconnected) == (False, False, False)
    assert cycle.waiting_for_100_continue is False
    # sidecar.transport.relay frames a body as the cycle does, once it knows the response is chunked
    assert cycle.chunked_encoding is None and protocol.flow.write_paused is False
    assert cycle.scope is protocol.scope and isinstance(protocol.scope["kvr.relay"], ClientRelay)
    await asyncio.gather(*protocol.tasks)
    assert cycle.response_started and cycle.response_complete and not cycle.disconnected
    assert state.total_requests == 1 and protocol.timeout_keep_alive_task is None
    assert bytes(transport.written).endswith(b"\r\n\r\nok")
    protocol.connection_lost(None)


async def test_what_uvicorns_on_response_complete_does_is_what_the_sidecars_does() -> None:
    # GuardedProtocol replaces it when nothing is pipelined: it must only count the request,
    # resume reading and start the keep-alive timer (the one step the sidecar does its own way).
    config = uvicorn.Config(app=_answer, lifespan="off", log_level="critical")
    state = ServerState()
    protocol = Protocol(config, state, {}, asyncio.get_running_loop())
    transport = FakeTransport()
    protocol.connection_made(transport)  # type: ignore[arg-type]
    protocol.data_received(REQUEST)
    protocol.flow.pause_reading()
    await asyncio.gather(*protocol.tasks)
    assert state.total_requests == 1 and not protocol.flow.read_paused and transport.reading
    timer = protocol.timeout_keep_alive_task
    assert isinstance(timer, asyncio.TimerHandle)
    assert timer.when() - protocol.loop.time() == pytest.approx(config.timeout_keep_alive, abs=0.5)
    assert not protocol.pipeline and len(transport.writes) == 2  # head, then body: two writes
    protocol.connection_lost(None)
    assert timer.cancelled()


async def _stream(scope: Any, receive: Any, send: Any) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": b"data: x\n\n", "more_body": True})
    await send({"type": "http.response.body", "body": b"", "more_body": False})


async def test_a_body_part_is_framed_by_the_cycle_as_the_relay_frames_it() -> None:
    config = uvicorn.Config(app=_stream, lifespan="off", log_level="critical")
    protocol = Protocol(config, ServerState(), {}, asyncio.get_running_loop())
    transport = FakeTransport()
    protocol.connection_made(transport)  # type: ignore[arg-type]
    protocol.data_received(REQUEST)
    await asyncio.gather(*protocol.tasks)
    relayed = FakeTransport()
    cycle = type("Cycle", (), {"disconnected": False, "transport": relayed})()
    ClientRelay(protocol, UvicornCycle(cycle)).write(b"data: x\n\n")  # type: ignore[arg-type]
    head, part, end = transport.writes
    assert b"transfer-encoding: chunked" in head and part == relayed.writes[0] and end == b"0\r\n\r\n"
    protocol.connection_lost(None)
