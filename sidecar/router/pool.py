"""Router mode's choice of P: the pool of prefill servers and the prefill leg's HTTP call.

Enabled by a static P pool (``--prefill URL[,URL...]``) and/or per request by
llm-d's ``x-prefiller-host-port`` header (one or more ``host:port``, each
checked against ``--prefill-allow``; ``parse_targets``). ``PrefillPool``
picks a P (least outstanding legs, or round robin), skips a failing one for
``prefill_backoff``, and keeps one pooled client per P.
"""

from __future__ import annotations

import itertools
import logging
import random
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import msgspec

from sidecar.config import Config
from sidecar.exceptions import SidecarError
from sidecar.network.allowlist import Allowlist, split_host_port
from sidecar.tls.client import outbound
from sidecar.upstream import Client, Upstream

log = logging.getLogger("sidecar.router")

MAX_DYNAMIC_PREFILLERS = 64
_DECODER = msgspec.json.Decoder()


class RouterError(SidecarError):
    """The prefill leg cannot run; ``status`` is what the client gets.

    ``body`` is P's own error answer when P refused the request (a 4xx the
    client should see as it is).
    """

    def __init__(
        self, status: int, message: str, param: str | None = None, body: bytes | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.param, self.body = status, param, body


class AnswerTooLarge(RouterError):
    """P answered more than ``prefill_answer_limit``: another P (or a retry) would answer the
    same, so it is neither retried nor held against P. P keeps that request's blocks until its
    lease: the parameters are at the end of an answer that was not read whole."""


@dataclass(frozen=True, slots=True)
class PrefillResult:
    """P's answer to the prefill leg."""

    url: str
    params: dict[str, Any] | None  # P's kv_transfer_params
    cached_tokens: int  # P's own prefix-cache hits, reported to the client
    # When P's answer arrived (time.monotonic()): P's lease on the blocks began just before.
    answered: float = field(default_factory=time.monotonic)


def parse_targets(value: bytes, allowlist: Allowlist, scheme: str = "http", pick: str = "") -> list[str]:
    """``x-prefiller-host-port`` to P URLs; raises RouterError(400) on a bad entry, 403 outside
    the allowlist. ``pick`` (``first`` or ``random``) keeps one entry before checking, as llm-d."""
    urls = []
    items = value.decode("latin-1").split(",")
    if pick:
        items = [items[0] if pick == "first" else random.choice(items)]
    for item in items:
        text = item.strip()
        target = split_host_port(text)
        if target is None:
            raise RouterError(
                400, f"x-prefiller-host-port: {text!r} is not host:port", "x-prefiller-host-port"
            )
        host, port = target
        if not allowlist.allows(host, port):
            raise RouterError(403, f"x-prefiller-host-port: {text!r} is not in the prefill allowlist")
        urls.append(f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}")
    if not urls:
        raise RouterError(400, "x-prefiller-host-port is empty", "x-prefiller-host-port")
    return urls


class PrefillPool:
    """Picks a P for each prefill leg and keeps one pooled client per P."""

    def __init__(
        self,
        config: Config,
        clock: Callable[[], float] = time.monotonic,
        allowlist: Allowlist | None = None,
        connect: Callable[[str], Client] | None = None,
    ) -> None:
        self.config = config
        self.static = list(config.prefill)
        self.allowlist = allowlist if allowlist is not None else Allowlist(config.prefill_allow)
        self._clock = clock
        self._outstanding: dict[str, int] = {}
        self._unhealthy_until: dict[str, float] = {}
        self._clients: OrderedDict[str, Client] = OrderedDict()
        self._connect = connect or self._upstream  # a fake per P in unit tests
        self._rotation = itertools.count()

    @classmethod
    def of(cls, config: Config, allowlist: Allowlist) -> PrefillPool | None:
        """Router mode's P servers: a static pool, or llm-d's header checked against ``allowlist``
        (``prefill_allow``, or an InferencePool's pods); None when neither is configured, unless
        the sidecar gives llm-d's answers: llm-d's header then always takes the router's path."""
        unlisted = not config.prefill and not config.prefill_allow and not config.inference_pool
        if unlisted and config.answers != "llm-d":
            return None
        if unlisted:
            log.warning(
                "no prefill allowlist: every x-prefiller-host-port is refused (403); set "
                "--enable-ssrf-protection with --inference-pool, or prefill_allow"
            )
        return cls(config, allowlist=allowlist)

    def candidates(self, header: bytes | None) -> list[str]:
        """The P URLs for one request, best first, healthy before backed-off ones."""
        policy = self.config.prefill_policy
        if header is not None:
            scheme = "https" if self.config.prefill_tls else "http"
            pick = policy if policy in ("first", "random") else ""
            urls = parse_targets(header, self.allowlist, scheme, pick)
        else:
            urls = list(self.static)
        if header is not None and policy in ("first", "random"):
            return urls  # the one P the header names: tried even while backed off, as llm-d does
        now = self._clock()
        healthy = [u for u in urls if self._unhealthy_until.get(u, 0.0) <= now]
        if policy in ("first", "random"):
            return _pick(policy, healthy)
        shift = next(self._rotation) % max(len(healthy), 1)
        healthy = healthy[shift:] + healthy[:shift]
        if policy == "least-outstanding":
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

    def _upstream(self, url: str) -> Client:
        return Upstream(
            url,
            connect_timeout=self.config.connect_timeout,
            pool_timeout=self.config.pool_timeout,
            header_timeout=self.config.prefill_timeout,
            read_timeout=self.config.read_timeout,
            pool_size=self.config.pool_size,
        ).use_tls(outbound(self.config.tls_ca_file, self.config.prefill_tls_insecure))

    async def client(self, url: str) -> Client:
        client = self._clients.get(url)
        if client is not None:
            self._clients.move_to_end(url)
            return client
        client = self._connect(url)
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
        limit = self.config.prefill_answer_limit
        with self.leg(url):
            client = await self.client(url)
            async with await client.send("POST", route, headers, body) as response:
                answer = await response.read(limit + 1)  # one byte more tells "over" from "exactly"
                status = response.status
        if len(answer) > limit:
            message = (
                f"prefill server {url} answered more than prefill_answer_limit ({limit} bytes); "
                "raise prefill_answer_limit (prompt_logprobs on a long prompt make P's answer large)"
            )
            raise AnswerTooLarge(502, message)
        if status != 200:
            message = f"prefill server answered {status}"
            raise RouterError(status, message, body=answer)
        return _prefill_result(url, answer)


def _pick(policy: str, urls: list[str]) -> list[str]:
    """A static pool with ``first`` or ``random``: that P first, the others after it."""
    if policy == "random" and urls:
        chosen = random.choice(urls)
        return [chosen, *(u for u in urls if u != chosen)]
    return urls


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
