"""Router mode's choice of P: the pool of prefill servers and the prefill leg's HTTP call.

Enabled by a static P pool (``--prefill URL[,URL...]``) and/or per request by
llm-d's ``x-prefiller-host-port`` header (one or more ``host:port``, each
checked against ``--prefill-allow``; ``parse_targets``). As llm-d reads it,
every line of the header counts, each a comma list, and an ``http://`` prefix
is dropped. A host name the allowlist admits only by address (CIDR entries, or
``prefill_allow_default = "routable"``) is resolved and checked address by
address, and the leg goes to the checked address (to the name with
``prefill_tls``, whose certificate names it). ``PrefillPool`` picks a P (least
outstanding legs, or round robin), skips a failing one for ``prefill_backoff``,
and keeps one pooled client per P.
"""

from __future__ import annotations

import itertools
import json
import logging
import random
import re
import ssl
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import msgspec

from sidecar.config import Config
from sidecar.exceptions import SidecarError
from sidecar.network.allowlist import Allowlist, ip_or_none, split_host_port
from sidecar.network.resolver import ResolveFailed, Resolver, Unresolvable
from sidecar.network.routable import RoutableAllowlist
from sidecar.proxy.answers import AnswerStyle
from sidecar.tls.client import outbound
from sidecar.upstream import Client, Response, Upstream, UpstreamError
from sidecar.wire import PREFILL_ANSWER_DECODER

log = logging.getLogger("sidecar.router")

MAX_DYNAMIC_PREFILLERS = 64


class RouterError(SidecarError):
    """The prefill leg cannot run; ``status`` is what the client gets.

    ``body`` is P's own error answer when P refused the request (a 4xx the
    client should see as it is).
    """

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        body: bytes | None = None,
        refused: str = "",
    ) -> None:
        super().__init__(message)
        self.status, self.param, self.body = status, param, body
        self.refused = refused  # a 403's reason: not_allowed, or routable.REFUSALS' (a metric label)


class AnswerTooLarge(RouterError):
    """P answered more than ``prefill_answer_limit``: another P (or a retry) would answer the
    same, so it is neither retried nor held against P.

    ``params`` are P's ``kv_transfer_params`` when its answer was a 200 read to its end,
    keeping only the last ``TAIL_BYTES`` (they are among its last members:
    ``params_at_end``); None otherwise. No decode leg is ever sent for such an answer, so D
    cannot read those blocks: the router releases them. ``answered`` is when P's answer began
    (its lease on the blocks began just before)."""

    def __init__(self, message: str, params: dict[str, Any] | None, answered: float) -> None:
        super().__init__(502, message)
        self.params, self.answered = params, answered


@dataclass(frozen=True, slots=True)
class PrefillResult:
    """P's answer to the prefill leg."""

    url: str
    params: dict[str, Any] | None  # P's kv_transfer_params
    cached_tokens: int  # P's own prefix-cache hits, reported to the client
    # When P's answer arrived (time.monotonic()): P's lease on the blocks began just before.
    answered: float = field(default_factory=time.monotonic)


def split_targets(value: bytes, pick: str = "") -> list[tuple[str, int]]:
    """``x-prefiller-host-port``'s (host, port) entries; raises RouterError(400) on a bad one.
    ``pick`` (``first`` or ``random``) keeps one entry before checking, as llm-d."""
    items = value.decode("latin-1").split(",")
    if pick:
        items = [items[0] if pick == "first" else random.choice(items)]
    targets = []
    for item in items:
        text = item.strip().removeprefix("http://")  # llm-d drops it (an older header form)
        target = split_host_port(text)
        if target is None:
            raise RouterError(
                400, f"x-prefiller-host-port: {text!r} is not host:port", "x-prefiller-host-port"
            )
        targets.append(target)
    if not targets:
        raise RouterError(400, "x-prefiller-host-port is empty", "x-prefiller-host-port")
    return targets


def parse_targets(value: bytes, allowlist: Allowlist, scheme: str = "http", pick: str = "") -> list[str]:
    """``x-prefiller-host-port`` to P URLs without name resolution; raises RouterError(400) on a
    bad entry, 403 outside the allowlist (a name must match a name entry)."""
    urls = []
    for host, port in split_targets(value, pick):
        if not allowlist.allows(host, port):
            raise _refused(allowlist, host, port)
        urls.append(_url(scheme, host, port))
    return urls


def _url(scheme: str, host: str, port: int) -> str:
    return f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"


def _refused(allowlist: Allowlist, host: str, port: int, address: str = "") -> RouterError:
    why = allowlist.why_not(address or host) if isinstance(allowlist, RoutableAllowlist) else None
    shown = f"{host}:{port}" + (f" ({address})" if address else "")
    if why is not None:
        message = f"x-prefiller-host-port: {shown} is a {why} address: no P is there"
        return RouterError(403, message, refused=why)
    message = f"x-prefiller-host-port: {shown} is not in the prefill allowlist"
    return RouterError(403, message, refused="not_allowed")


class PrefillPool:
    """Picks a P for each prefill leg and keeps one pooled client per P."""

    def __init__(
        self,
        config: Config,
        clock: Callable[[], float] = time.monotonic,
        allowlist: Allowlist | None = None,
        connect: Callable[[str], Client] | None = None,
        resolver: Resolver | None = None,
    ) -> None:
        self.config = config
        self.static = list(config.prefill)
        self.allowlist = allowlist if allowlist is not None else Allowlist(config.prefill_allow)
        self.resolver = resolver or Resolver()
        self._clock = clock
        self.outstanding: dict[str, int] = {}  # prefill legs in flight, by P
        self._unhealthy_until: dict[str, float] = {}
        self._clients: OrderedDict[str, Client] = OrderedDict()
        self._connect = connect or self._upstream  # a fake per P in unit tests
        # Every https P's. Building it reads the whole trust store (the system's, tls_ca_file,
        # SSL_CERT_FILE, each SSL_CERT_DIR file): at start, never for a plain-http P, whose first
        # prefill leg would otherwise hold the event loop and every stream arriving meanwhile.
        https = config.prefill_tls or any(url.startswith("https:") for url in self.static)
        self._tls: ssl.SSLContext | None = self._outbound() if https else None
        self._rotation = itertools.count()

    @classmethod
    def of(cls, config: Config, allowlist: Allowlist, answers: AnswerStyle) -> PrefillPool | None:
        """Router mode's P servers: a static pool, or llm-d's header checked against ``allowlist``
        (``prefill_allow``, or an InferencePool's pods); None when neither is configured, unless
        the ``answers`` are llm-d's: llm-d's header then always takes the router's path."""
        unlisted = not config.prefill and not config.prefill_allow and not config.inference_pool
        if unlisted and not answers.routes_unlisted:
            return None
        if unlisted and isinstance(allowlist, RoutableAllowlist):
            log.warning(
                "no prefill allowlist: x-prefiller-host-port may name any P address but loopback, "
                "link-local, cloud metadata, unspecified and multicast ones (llm-d connects to any); "
                "set --enable-ssrf-protection with --inference-pool to admit only the pool's pods"
            )
        elif unlisted:
            log.warning(
                "no prefill allowlist: every x-prefiller-host-port is refused (403); set "
                "--enable-ssrf-protection with --inference-pool, or prefill_allow"
            )
        return cls(config, allowlist=allowlist)

    async def candidates(self, header: bytes | None) -> list[str]:
        """The P URLs for one request, best first, healthy before backed-off ones."""
        policy = self.config.prefill_policy
        if header is not None:
            pick = policy if policy in ("first", "random") else ""
            urls = [await self._checked(host, port) for host, port in split_targets(header, pick)]
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
            healthy.sort(key=lambda u: self.outstanding.get(u, 0))
        return healthy

    async def _checked(self, host: str, port: int) -> str:
        """The URL of a header-named P the allowlist admits; raises RouterError (403, or 502/503
        for a name that does not resolve)."""
        tls = self.config.prefill_tls
        scheme = "https" if tls else "http"
        allowlist = self.allowlist
        if allowlist.allows(host, port):
            return _url(scheme, host, port)
        if ip_or_none(host) is not None or not allowlist.may_admit_address(port):
            raise _refused(allowlist, host, port)
        try:
            addresses = await self.resolver.resolve(host, port)
        except Unresolvable as exc:
            raise RouterError(502, f"x-prefiller-host-port: {exc}") from exc
        except ResolveFailed as exc:
            raise RouterError(503, f"x-prefiller-host-port: {exc}") from exc
        for address in addresses:
            if not allowlist.allows(address, port):
                raise _refused(allowlist, host, port, address)
        return _url(scheme, host if tls else addresses[0], port)

    @contextmanager
    def leg(self, url: str) -> Iterator[None]:
        """Count one prefill leg in flight on ``url`` while the block runs (least-outstanding)."""
        self.outstanding[url] = self.outstanding.get(url, 0) + 1
        try:
            yield
        finally:
            self.outstanding[url] -= 1

    def mark_failed(self, url: str) -> None:
        self._unhealthy_until[url] = self._clock() + self.config.prefill_backoff

    def _upstream(self, url: str) -> Client:
        upstream = Upstream(
            url,
            connect_timeout=self.config.connect_timeout,
            pool_timeout=self.config.pool_timeout,
            header_timeout=self.config.prefill_timeout,
            read_timeout=self.config.read_timeout,
            pool_size=self.config.pool_size,
        )
        return upstream.use_tls(self._tls_context()) if url.startswith("https:") else upstream

    def _outbound(self) -> ssl.SSLContext:
        return outbound(self.config, self.config.prefill_tls_insecure)

    def _tls_context(self) -> ssl.SSLContext:
        # Once: it reads the trusted files and folders, as Go reads them once per process.
        if self._tls is None:
            self._tls = self._outbound()
        return self._tls

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
                answered = time.monotonic()
                answer = await response.read(limit + 1)  # one byte more tells "over" from "exactly"
                status = response.status
                if len(answer) > limit:
                    params = await _params_past_limit(response, answer) if status == 200 else None
                    message = (
                        f"prefill server {url} answered more than prefill_answer_limit ({limit} bytes); "
                        "raise prefill_answer_limit (prompt_logprobs on a long prompt make P's answer large)"
                    )
                    raise AnswerTooLarge(message, params, answered)
        if status != 200:
            message = f"prefill server answered {status}"
            raise RouterError(status, message, body=answer)
        return _prefill_result(url, answer)


#: What is kept of an answer over ``prefill_answer_limit`` while the rest is read: its end, where
#: ``kv_transfer_params`` are. Their bulk is the block ids, about 7 bytes each in vLLM's JSON; a
#: 131,072-token prompt at 16 tokens a block has 8,192 per KV cache group: 4 MiB holds 500,000.
TAIL_BYTES = 4 << 20
_PARAMS_KEY = re.compile(rb'"kv_transfer_params"\s*:')
_JSON = json.JSONDecoder()


async def _params_past_limit(response: Response, head: bytes) -> dict[str, Any] | None:
    """P's parameters from the end of a 200 answer over the limit: the rest is read keeping only
    its last ``TAIL_BYTES`` (memory stays bounded; the time it takes is bounded by P's lease, past
    which the judge releases nothing). None when it breaks off or does not end in them
    (``params_at_end``)."""
    tail = bytearray(head[-TAIL_BYTES:])
    try:
        async for chunk in response.chunks():
            tail += chunk
            if len(tail) > 2 * TAIL_BYTES:  # cut now and then: each byte is moved about once
                del tail[:-TAIL_BYTES]
    except UpstreamError:
        return None
    return params_at_end(bytes(tail[-TAIL_BYTES:]))


def params_at_end(tail: bytes) -> dict[str, Any] | None:
    """``kv_transfer_params`` of the JSON object whose last bytes are ``tail``, when they are a
    member of that object itself; None otherwise.

    vLLM's answers put them after every large member (``choices``, ``prompt_logprobs``,
    ``prompt_token_ids``), followed at most by small ones (``ec_transfer_params``, ``metrics``).
    A JSON string cannot hold an unescaped quote, so ``"kv_transfer_params":`` outside strings
    is a key. It is the top object's own when what follows its value is the rest of that object:
    further members, then its closing brace and nothing else (one nested deeper is followed by
    more than one closing brace).
    """
    text = tail.decode("utf-8", errors="replace")  # only the cut first character can be invalid
    # The last few keys: the answer's own comes after its large members, a nested one (if any) in
    # the small members after it.
    for match in list(_PARAMS_KEY.finditer(tail))[-4:][::-1]:
        start = len(tail[: match.end()].decode("utf-8", errors="replace"))
        try:
            value, end = _JSON.raw_decode(text, _skip_space(text, start))
        except ValueError:
            continue
        rest = text[end:].strip()
        if rest == "}" or (rest.startswith(",") and _object("{" + rest[1:])):
            return value if isinstance(value, dict) else None
    return None


def _skip_space(text: str, at: int) -> int:
    while at < len(text) and text[at] in " \t\r\n":
        at += 1
    return at


def _object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


def _pick(policy: str, urls: list[str]) -> list[str]:
    """A static pool with ``first`` or ``random``: that P first, the others after it."""
    if policy == "random" and urls:
        chosen = random.choice(urls)
        return [chosen, *(u for u in urls if u != chosen)]
    return urls


def _prefill_result(url: str, answer: bytes) -> PrefillResult:
    try:
        payload = PREFILL_ANSWER_DECODER.decode(answer)
    except msgspec.ValidationError as exc:  # valid JSON, but not an object
        raise RouterError(502, f"prefill server {url} answered a non-object") from exc
    except msgspec.DecodeError as exc:
        raise RouterError(502, f"prefill server {url} answered invalid JSON") from exc
    params = payload.kv_transfer_params
    return PrefillResult(url, params if isinstance(params, dict) else None, _cached_tokens(payload.usage))


def _cached_tokens(usage: Any) -> int:
    if not isinstance(usage, dict):
        return 0
    for key in ("prompt_tokens_details", "input_tokens_details"):
        details = usage.get(key)
        if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
            return int(details["cached_tokens"])
    return 0
