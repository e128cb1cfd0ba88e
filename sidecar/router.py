"""Router mode: the sidecar runs the prefill leg on P, then the decode leg on D.

Enabled by a static P pool (``--prefill URL[,URL...]``) and/or per request by
llm-d's ``x-prefiller-host-port`` header (one or more ``host:port``, each
checked against ``--prefill-allow``). The prefill leg is vLLM's reference
P/D proxy's: the same body with ``stream: false``, the output budget set to 1
(``max_tokens``; ``max_completion_tokens`` for chat; ``max_output_tokens``
for responses), ``stream_options`` removed and ``kv_transfer_params`` asking
P to keep the blocks for a remote decode. The decode leg is the original
body plus the ``kv_transfer_params`` P returned, with the same
``x-request-id`` (older vLLM releases derive the shared request id from it).
Client-supplied ``kv_transfer_params`` are dropped: they could name any host.

Because the router holds P's parameters itself, it releases in more cases
than the sidecar mode does (``Exchange.router``): when the client leaves or
the decode leg times out before headers, the router closes the connection to
D, which aborts the request, so no live request reads the blocks any more.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import msgspec

from sidecar.allowlist import Allowlist, split_host_port
from sidecar.config import Config
from sidecar.upstream import Upstream

log = logging.getLogger("sidecar.router")

HEADER = b"x-prefiller-host-port"
MAX_DYNAMIC_PREFILLERS = 64
PREFILL_BODY_LIMIT = 1024 * 1024
_DECODER = msgspec.json.Decoder()
_ENCODER = msgspec.json.Encoder()

# What the prefill leg asks of P (vLLM's toy_proxy_server / disagg proxy).
PREFILL_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


class RouterError(Exception):
    """The prefill leg cannot run; ``status`` is what the client gets.

    ``body`` is P's own error answer when P refused the request (a 4xx the
    client should see as it is).
    """

    def __init__(
        self, status: int, message: str, param: str | None = None, body: bytes | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.param, self.body = status, param, body


@dataclass(frozen=True, slots=True)
class PrefillResult:
    """P's answer to the prefill leg."""

    url: str
    params: dict[str, Any] | None  # P's kv_transfer_params
    cached_tokens: int  # P's own prefix-cache hits, reported to the client


def prefill_body(request: dict[str, Any], route: str) -> bytes:
    """The prefill leg's body: same prompt, no stream, an output budget of one token."""
    body = dict(request)
    body["stream"] = False
    body.pop("stream_options", None)
    if route == "/v1/responses":
        body["max_output_tokens"] = 1
    else:
        body["max_tokens"] = 1
        if route == "/v1/chat/completions" and "max_completion_tokens" in body:
            body["max_completion_tokens"] = 1
    body["kv_transfer_params"] = dict(PREFILL_PARAMS)
    return _ENCODER.encode(body)


def decode_body(request: dict[str, Any], params: dict[str, Any] | None) -> bytes:
    """The decode leg's body: the original request plus P's kv_transfer_params."""
    body = dict(request)
    if params is None:
        body.pop("kv_transfer_params", None)
    else:
        body["kv_transfer_params"] = params
    return _ENCODER.encode(body)


def parse_targets(value: bytes, allowlist: Allowlist) -> list[str]:
    """``x-prefiller-host-port`` to P URLs; raises RouterError(400) on a bad or disallowed entry."""
    urls = []
    for item in value.decode("latin-1").split(","):
        text = item.strip()
        target = split_host_port(text)
        if target is None:
            raise RouterError(
                400, f"x-prefiller-host-port: {text!r} is not host:port", "x-prefiller-host-port"
            )
        host, port = target
        if not allowlist.allows(host, port):
            raise RouterError(400, f"x-prefiller-host-port: {text!r} is not in the prefill allowlist")
        urls.append(f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}")
    if not urls:
        raise RouterError(400, "x-prefiller-host-port is empty", "x-prefiller-host-port")
    return urls


class PrefillPool:
    """Picks a P for each prefill leg and keeps one pooled client per P."""

    def __init__(self, config: Config, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.static = list(config.prefill)
        self.allowlist = Allowlist(config.prefill_allow)
        self._clock = clock
        self._outstanding: dict[str, int] = {}
        self._unhealthy_until: dict[str, float] = {}
        self._clients: OrderedDict[str, Upstream] = OrderedDict()
        self._rotation = itertools.count()

    def candidates(self, header: bytes | None) -> list[str]:
        """The P URLs for one request, best first, healthy before backed-off ones."""
        urls = parse_targets(header, self.allowlist) if header is not None else list(self.static)
        now = self._clock()
        healthy = [u for u in urls if self._unhealthy_until.get(u, 0.0) <= now]
        shift = next(self._rotation) % max(len(healthy), 1)
        healthy = healthy[shift:] + healthy[:shift]
        if self.config.prefill_policy == "least-outstanding":
            # A stable sort of the rotated list: ties (an idle pool) take turns.
            healthy.sort(key=lambda u: self._outstanding.get(u, 0))
        return healthy

    @contextmanager
    def leg(self, url: str) -> Iterator[None]:
        """Count one prefill leg in flight on ``url`` while the block runs (least-outstanding)."""
        self._outstanding[url] = self._outstanding.get(url, 0) + 1
        try:
            yield
        finally:
            self._outstanding[url] -= 1

    def outstanding(self, url: str) -> int:
        """Prefill legs in flight on ``url``."""
        return self._outstanding.get(url, 0)

    def mark_failed(self, url: str) -> None:
        self._unhealthy_until[url] = self._clock() + self.config.prefill_backoff

    async def client(self, url: str) -> Upstream:
        client = self._clients.get(url)
        if client is not None:
            self._clients.move_to_end(url)
            return client
        client = Upstream(
            url,
            connect_timeout=self.config.connect_timeout,
            pool_timeout=self.config.pool_timeout,
            header_timeout=self.config.prefill_timeout,
            read_timeout=self.config.read_timeout,
            pool_size=self.config.pool_size,
        )
        await client.start()
        self._clients[url] = client
        if len(self._clients) > MAX_DYNAMIC_PREFILLERS + len(self.static):
            _, oldest = self._clients.popitem(last=False)
            await oldest.close()
        return client

    async def close(self) -> None:
        for client in self._clients.values():
            await client.close()
        self._clients.clear()

    async def prefill(
        self, url: str, route: str, body: bytes, headers: list[tuple[str, str]]
    ) -> PrefillResult:
        """Run the prefill leg on ``url``; raises UpstreamError or RouterError."""
        with self.leg(url):
            client = await self.client(url)
            async with await client.send("POST", route, headers, body) as response:
                answer = await response.read(PREFILL_BODY_LIMIT)
                status = response.status
        if status != 200:
            message = f"prefill server answered {status}"
            raise RouterError(status, message, body=answer)
        return _prefill_result(url, answer)


def _prefill_result(url: str, answer: bytes) -> PrefillResult:
    try:
        payload = _DECODER.decode(answer)
    except msgspec.DecodeError as exc:
        raise RouterError(502, f"prefill server {url} answered invalid JSON") from exc
    if not isinstance(payload, dict):
        raise RouterError(502, f"prefill server {url} answered a non-object")
    params = payload.get("kv_transfer_params")
    return PrefillResult(url, params if isinstance(params, dict) else None, _cached_tokens(payload))


def _cached_tokens(payload: dict[str, Any]) -> int:
    usage = payload.get("usage")
    if not isinstance(usage, dict):
        return 0
    for key in ("prompt_tokens_details", "input_tokens_details"):
        details = usage.get(key)
        if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
            return int(details["cached_tokens"])
    return 0


def correct_usage(payload: Any, cached_tokens: int) -> bool:
    """Report P's cached tokens instead of D's (D got the whole prompt from P). True if changed."""
    usage = payload.get("usage") if isinstance(payload, dict) else None
    if not isinstance(usage, dict):
        return False
    changed = False
    for key in ("prompt_tokens_details", "input_tokens_details"):
        details = usage.get(key)
        if isinstance(details, dict) and "cached_tokens" in details:
            details["cached_tokens"] = cached_tokens
            changed = True
    return changed


class UsageRewriter:
    """Corrects ``cached_tokens`` in D's answer as it passes (JSON body or SSE events)."""

    def __init__(self, cached_tokens: int, stream: bool) -> None:
        self.cached_tokens = cached_tokens
        self.stream = stream
        self._pending = b""

    def json(self, body: bytes) -> bytes:
        try:
            payload = _DECODER.decode(body)
        except msgspec.DecodeError:
            return body
        return _ENCODER.encode(payload) if correct_usage(payload, self.cached_tokens) else body

    def feed(self, chunk: bytes) -> bytes:
        """Complete SSE events of ``chunk`` (corrected); a trailing partial event is held back."""
        data = self._pending + chunk
        end = data.rfind(b"\n\n")
        if end < 0:
            self._pending = data
            return b""
        self._pending = data[end + 2 :]
        events = data[: end + 2]
        if b"cached_tokens" not in events:
            return events
        return b"".join(self._event(e) for e in events.split(b"\n\n")[:-1])

    def flush(self) -> bytes:
        rest, self._pending = self._pending, b""
        return rest

    def _event(self, event: bytes) -> bytes:
        if b"cached_tokens" not in event:
            return event + b"\n\n"
        lines = event.split(b"\n")
        for index, line in enumerate(lines):
            if line.startswith(b"data:"):
                try:
                    payload = _DECODER.decode(line[5:].strip())
                except msgspec.DecodeError:
                    continue
                if correct_usage(payload, self.cached_tokens):
                    lines[index] = b"data: " + _ENCODER.encode(payload)
        return b"\n".join(lines) + b"\n\n"


def prefill_headers(headers: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """Client headers for P: the same, minus the length (the body changes) and the routing header."""
    return [(n, v) for n, v in headers if n not in ("content-length", "x-prefiller-host-port")]
