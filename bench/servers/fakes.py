"""``python -m bench.servers.fakes --role prefill|reject --port P``: a fake P, or a D that rejects.

The simulators (``sim-prefill``, ``sim-decode``) are Starlette apps at some
hundreds of microseconds per request, which would fill the load core before
the hop under test at thousands of requests per second. These answer from
precomputed bytes in asyncio Protocols on uvloop, requests parsed by llhttp
(``httptools``), at tens of microseconds each:

* ``--role prefill``: a completion is answered as a prefill leg: JSON with
  ``kv_transfer_params`` naming a fresh request id, for the decode leg (the
  many-streams workload's router mode, ``bench.streams``). Only a prefill
  leg: ``stream`` false, ``max_tokens`` 1 and ``kv_transfer_params`` with
  ``do_remote_decode`` (what the sidecar in router mode, vllm-router and the
  bench's own client send); anything else is refused 400, so a hop that sends
  P something else shows as errors. ``GET /stats`` counts what came: prefill
  legs, those with an ``X-Request-Id`` header or ``min_tokens``, refused
  ones, and other requests (vllm-router's ``/render`` under its default
  policy);
* ``--role reject``: a completion is answered 400 the way vLLM's validation
  handler refuses a body, before its handler, so the sidecar releases P's
  blocks (the release-throughput workload, ``bench.releases``).

Both answer ``GET /health`` (200), ``GET /version`` and ``GET /stats``; anything else 404.
Connections are kept alive. ``--port 0`` binds any free port; the first line
on stdout says which.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import signal
from collections.abc import Sequence
from typing import cast

import httptools
import msgspec
import uvloop

from sidecar.wire import error_body

BACKLOG = 4096
VERSION = "0.34.0"
MODEL = "sim-model"
_ENCODER = msgspec.json.Encoder()
_REJECTION = error_body(
    "1 validation error:\n  {'type': 'int_parsing', 'loc': ('body', 'max_tokens'), "
    "'msg': 'Input should be a valid integer', 'input': 'x'}",
    400,
    "Bad Request",
    "body.max_tokens",
)


class _Kv(msgspec.Struct):
    do_remote_decode: bool = False


class PrefillView(msgspec.Struct):
    """The fields of a prefill leg the fake P checks and counts (the rest is not decoded)."""

    stream: bool = False
    max_tokens: int | None = None
    min_tokens: int | None = None
    kv_transfer_params: _Kv | None = None


_VIEW = msgspec.json.Decoder(PrefillView)
#: What ``GET /stats`` counts, in this order.
COUNTS = ("legs", "with_request_id", "with_min_tokens", "refused", "other")


def prefill_refusal(body: bytes) -> str | None:
    """Why ``body`` is not a prefill leg (None when it is one)."""
    try:
        view = _VIEW.decode(body)
    except msgspec.DecodeError as exc:
        return f"not a prefill leg: {exc}"
    if view.stream or view.max_tokens != 1:
        return f"not a prefill leg: stream {view.stream}, max_tokens {view.max_tokens} (want false, 1)"
    if view.kv_transfer_params is None or not view.kv_transfer_params.do_remote_decode:
        return "not a prefill leg: no kv_transfer_params with do_remote_decode true"
    return None


def _response(status: str, body: bytes, content_type: bytes = b"application/json") -> bytes:
    return (
        b"HTTP/1.1 " + status.encode() + b"\r\ncontent-type: " + content_type + b"\r\ncontent-length: "
        + str(len(body)).encode() + b"\r\n\r\n" + body
    )  # fmt: skip


def prefill_answer(request_id: str) -> bytes:
    """P's answer to a prefill leg: one token, and the parameters D's leg needs."""
    params = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": "bench-prefill-0",
        "remote_request_id": request_id,
        "remote_host": "127.0.0.1",
        "remote_port": 5600,
        "remote_block_ids": [[1, 2, 3, 4]],
        "tp_size": 1,
    }
    body = {
        "id": "cmpl-" + request_id,
        "object": "chat.completion",
        "created": 0,
        "model": MODEL,
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": " tok"}, "finish_reason": "length"}
        ],
        "usage": {"prompt_tokens": 8, "completion_tokens": 1, "total_tokens": 9},
        "kv_transfer_params": params,
    }
    return _response("200 OK", _ENCODER.encode(body))


class Server:
    """What every connection shares: the role and the counters."""

    def __init__(self, role: str) -> None:
        self.role = role
        self.ids = itertools.count()
        self.requests = 0
        self.counts = dict.fromkeys(COUNTS, 0)

    def prefill(self, body: bytes, request_id: bool) -> bytes:
        """The answer to a completion on P, counted."""
        counts = self.counts
        refusal = prefill_refusal(body)
        if refusal is not None:
            counts["refused"] += 1
            return _response("400 Bad Request", error_body(refusal, 400, "BadRequestError"))
        counts["legs"] += 1
        counts["with_request_id"] += request_id
        counts["with_min_tokens"] += b'"min_tokens"' in body
        return prefill_answer(f"bench-{next(self.ids)}")


_HEALTH = b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n"
_VERSION = _response("200 OK", _ENCODER.encode({"version": VERSION}))
_NOT_FOUND = _response("404 Not Found", error_body("not found", 404, "NotFoundError"))
_COMPLETIONS = (b"/v1/chat/completions", b"/v1/completions")


class _Conn(asyncio.Protocol):
    """One client connection: requests parsed by llhttp, answered in order."""

    def __init__(self, server: Server) -> None:
        self._server = server
        self._parser = httptools.HttpRequestParser(self)
        self._transport: asyncio.Transport | None = None
        self._url = b""
        self._body = b""
        self._request_id = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError:
            self._close()

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() == b"x-request-id":
            self._request_id = True

    def on_body(self, body: bytes) -> None:
        self._body += body

    def on_message_complete(self) -> None:
        url, self._url = self._url, b""
        body, self._body = self._body, b""
        request_id, self._request_id = self._request_id, False
        server, transport, method = self._server, self._transport, self._parser.get_method()
        if transport is None:
            return
        path = url.split(b"?", 1)[0]
        if method == b"GET" and path == b"/health":
            transport.write(_HEALTH)
        elif method == b"GET" and path == b"/version":
            transport.write(_VERSION)
        elif method == b"GET" and path == b"/stats":
            transport.write(_response("200 OK", _ENCODER.encode(server.counts)))
        elif method != b"POST" or path not in _COMPLETIONS:
            server.counts["other"] += method == b"POST"
            transport.write(_NOT_FOUND)
        elif server.role == "prefill":
            server.requests += 1
            transport.write(server.prefill(body, request_id))
        else:
            server.requests += 1
            transport.write(_response("400 Bad Request", _REJECTION))

    def _close(self) -> None:
        if self._transport is not None:
            self._transport.close()


async def serve(args: argparse.Namespace) -> None:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    shared = Server(args.role)
    server = await loop.create_server(lambda: _Conn(shared), args.host, args.port, backlog=BACKLOG)
    host, port = server.sockets[0].getsockname()[:2]
    print(f"{args.role} listening on {host}:{port}", flush=True)
    await stop.wait()
    server.close()
    print(f"answered {shared.requests} completion requests", flush=True)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.servers.fakes", description=__doc__.split("\n")[0])
    parser.add_argument("--role", choices=["prefill", "reject"], required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True, help="0: any free port")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(serve(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
