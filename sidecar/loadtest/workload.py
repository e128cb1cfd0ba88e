"""What the load generator sends: prompt lengths, request bodies, request kinds, both legs.

Prompt lengths (in words; the simulators count one token per word) come
from a mixture: very short prompts (1-3 words), prompts of exactly k blocks,
and a log-normal body around four blocks, capped at ``max_prompt``. A
``Workload`` is a weighted list of ``Kind``: the load test's own is a single
plain kind; the demo adds kinds D rejects for realistic reasons. Every plan
is drawn from a generator seeded by (seed, index), so two runs with the same
seed send the same requests whatever their timing. ``prefill_body`` is the
prefill leg of vLLM's reference P/D proxy (``toy_proxy_server.py``).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from sidecar.loadtest.config import ROUTE_PATHS, LoadConfig

Body = dict[str, Any]
VOCABULARY = (
    *("the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "seven", "small"),
    *("birds", "sing", "about", "rivers", "mountains", "cities", "lights", "trains", "letters"),
    *("numbers", "gardens", "winter", "summer", "morning", "evening"),
)
SHORT_SHARE = 0.15  # prompts of 1-3 words
BLOCK_MULTIPLE_SHARE = 0.25  # prompts of exactly k blocks
MAX_BLOCK_MULTIPLE = 8


def prompt_words(rng: random.Random, block_size: int, max_prompt: int) -> int:
    """One prompt length in words, from the mixture described in the module docstring."""
    draw = rng.random()
    if draw < SHORT_SHARE:
        return min(max_prompt, rng.randint(1, 3))
    if draw < SHORT_SHARE + BLOCK_MULTIPLE_SHARE and max_prompt >= block_size:
        return block_size * rng.randint(1, min(MAX_BLOCK_MULTIPLE, max_prompt // block_size))
    length = int(rng.lognormvariate(math.log(4 * block_size), 0.8))
    return max(1, min(max_prompt, length))


def prompt_text(rng: random.Random, words: int) -> str:
    """``words`` words from a small vocabulary."""
    return " ".join(rng.choice(VOCABULARY) for _ in range(words))


def client_body(route: str, model: str, prompt: str, max_tokens: int, stream: bool) -> Body:
    """The body a client sends to the router (``route`` is completions or chat)."""
    body: Body = {"model": model, "max_tokens": max_tokens, "stream": stream}
    if route == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


def prefill_body(body: Body, route: str) -> Body:
    """The reference proxy's prefill leg: one token, not streamed, P keeps the KV for D."""
    leg = dict(body)
    leg["kv_transfer_params"] = {"do_remote_decode": True, "do_remote_prefill": False}
    leg["stream"] = False
    leg["max_tokens"] = 1
    if route == "chat":
        leg["max_completion_tokens"] = 1
    leg.pop("stream_options", None)
    return leg


def decode_body(body: Body, kv_transfer_params: Mapping[str, Any]) -> Body:
    """The decode leg: the client's body plus the ``kv_transfer_params`` P answered."""
    return {**body, "kv_transfer_params": dict(kv_transfer_params)}


@dataclass(frozen=True)
class Kind:
    """One kind of request in a workload, drawn with probability proportional to ``weight``.

    ``edit`` changes the client's body (so both legs); ``words`` overrides
    the prompt length; ``stream`` forces the decode leg to stream or not;
    ``decode_url`` and ``decode_headers`` change where and how the decode
    leg is sent (a D that is down, a wrong API key).
    """

    name: str
    weight: float = 1.0
    edit: Callable[[Body, random.Random], Body] | None = None
    words: Callable[[random.Random], int] | None = None
    stream: bool | None = None
    decode_url: str | None = None
    decode_headers: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Plan:
    """One P->D flow, fully decided before it starts."""

    index: int
    request_id: str
    kind: str
    path: str
    body: Body
    stream: bool
    prompt_words: int
    prefill_headers: Mapping[str, str]
    decode_url: str
    decode_headers: Mapping[str, str]


class Workload:
    """A weighted list of kinds; ``plan(index)`` draws one flow reproducibly."""

    def __init__(self, kinds: list[Kind]) -> None:
        if not kinds or sum(kind.weight for kind in kinds) <= 0:
            raise ValueError("a workload needs at least one kind with a positive weight")
        self.kinds = kinds
        self._weights = [kind.weight for kind in kinds]

    def plan(self, config: LoadConfig, model: str, run_id: str, index: int) -> Plan:
        rng = random.Random(f"{config.seed}:{index}")
        kind = rng.choices(self.kinds, self._weights)[0]
        words = kind.words(rng) if kind.words else prompt_words(rng, config.block_size, config.max_prompt)
        stream = kind.stream if kind.stream is not None else rng.random() < config.stream_share
        body = client_body(config.route, model, prompt_text(rng, words), config.max_tokens, stream)
        if kind.edit is not None:
            body = kind.edit(body, rng)
        headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
        return Plan(
            index=index,
            request_id=f"{run_id}-{index:06d}",
            kind=kind.name,
            path=ROUTE_PATHS[config.route],
            body=body,
            stream=stream,
            prompt_words=words,
            prefill_headers=headers,
            decode_url=kind.decode_url or config.decode_url,
            decode_headers={**headers, **kind.decode_headers},
        )


def plain_workload() -> Workload:
    """The load test's own workload: ordinary requests only; rejections are D's own."""
    return Workload([Kind("plain")])
