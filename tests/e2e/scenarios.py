"""The e2e scenarios: what each request is, what P must show for it, and the bodies both legs carry.

A scenario is one request whose prompt P has pinned: the base body of its
route (greedy, 8 tokens) changed by the scenario's fault. Sidecar modes
(``nixl``, ``http``, and ``off`` for the negative control) pin on P with the
base body as a P/D router would (``sidecar.router.bodies.prefill_body``) and
send the faulty decode leg with P's ``kv_transfer_params`` through the
sidecar; router mode sends the faulty body to the sidecar, which runs both
legs (its prefill leg asks P for one token, so a fault in ``max_tokens``
reaches D only).

``Expect`` says who must free P's blocks. The groups follow where vLLM 0.32
answers: before the completion handler (nobody in D notifies P: the
sidecar's job), inside it (vLLM's own ``notify_kv_transfer_request_rejected``
notifies P: the sidecar must stay silent), in a stream after HTTP 200 (the
handler returned a stream, D's fix does not fire), and D down.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Literal

from sidecar.router.bodies import prefill_body

Mode = Literal[
    "nixl",
    "http",
    "router",
    "auto",
    "defaults",
    "pods",
    "off",
    "vllm-router",
    "vllm-router-bare",
    "smg",
    "smg-bare",
]
#: The modes whose front runs the prefill leg itself: the client's body goes to it, not P's parameters.
ROUTED: frozenset[str] = frozenset({"router", "vllm-router", "vllm-router-bare", "smg", "smg-bare"})
#: The controls: a router in front of D itself, no sidecar; what the sidecar frees elsewhere P's lease frees.
BARE: frozenset[str] = frozenset({"vllm-router-bare", "smg-bare"})
COMPLETIONS, CHAT, RESPONSES = "/v1/completions", "/v1/chat/completions", "/v1/responses"
MESSAGES, GENERATE = "/v1/messages", "/inference/v1/generate"
OUTPUT_TOKENS = 8
WORDS = (
    *("ka", "lo", "mi", "ne", "ru", "ta", "po", "si", "de", "fu"),
    *("ga", "he", "ji", "wo", "ze", "by", "cu", "vo", "xi", "qa"),
)


class Expect(StrEnum):
    """Who frees P's blocks, as P's evidence must show it."""

    D_READS = "D reads them, the sidecar sends nothing"
    SIDECAR_FREES = "the sidecar frees them at once"
    D_FREES = "D's own fix frees them, the sidecar sends nothing"
    LEASE = "P's lease frees them (nobody can release)"
    LEFT = "P's lease frees them (the sidecar leaves them to a front's retry on another pod)"
    NOT_PINNED = "P pinned nothing"


@dataclass(frozen=True)
class Scenario:
    """One request kind. ``change`` is merged into the route's base body (the fault)."""

    key: str
    title: str
    group: str
    route: str
    expect: Expect
    change: dict[str, Any] = field(default_factory=dict)
    stream: bool = False
    headers: tuple[tuple[str, str], ...] = ()
    content_type: str = "application/json"
    oversize: bool = False  # padded over the sidecar's body cap
    d_down: bool = False  # run with D stopped
    long_prompt: bool = False  # a prompt over one KV block (admitted requests: D reads them all)
    status: int = 0  # the status the client must get (0: from the group)
    keyless: bool = False  # sent without D's API key (the smg modes, whose D requires one)
    prefills: int = 1  # the prefills P runs for it (a front that retries the pair runs more)

    def expectation(self, mode: Mode) -> Expect:
        """What P must show in ``mode``. D down: the control strategy cannot reach D, and the
        shipped defaults leave the sidecar's 503 to a retry on another decode pod
        (``retried_statuses`` 502,503,504; ``pods``: both pods' D down): in all three, P's
        lease frees the blocks."""
        if self.d_down and mode == "http":
            return Expect.LEASE
        if mode in BARE and self.expect is Expect.SIDECAR_FREES:
            return Expect.LEASE  # the control: the router straight to D, no sidecar
        if self.d_down and mode in ("defaults", "pods"):
            return Expect.LEFT
        return self.expect

    def expected_status(self) -> int:
        """The status the client must see: the scenario's own, else its group's."""
        return self.status or GROUP_STATUS[self.group]

    def also_accepted(self, mode: Mode) -> frozenset[int]:
        """Another status the client may see in ``mode``. Both pods' D down behind nginx: nginx
        passes on the second pod's 503, or answers its own 502 ("no live upstreams") while it still
        avoids the pod that failed in the last 10 s (``max_fails`` 1, ``fail_timeout`` 10 s, its
        defaults), so that no second pod is tried; either way no pod could serve it."""
        return frozenset({502}) if self.d_down and mode == "pods" else frozenset()


ADMITTED, PRE, AFTER_200, HANDLER, DOWN, CAP = (
    "admitted",
    "before D's handler",
    "stream error after 200",
    "D's handler",
    "D down",
    "sidecar's body cap",
)
GROUP_STATUS = {ADMITTED: 200, PRE: 400, AFTER_200: 200, HANDLER: 400, DOWN: 503, CAP: 413}


@dataclass(frozen=True)
class OverContext:
    """A field value sized from D's ``max_model_len`` when the body is built (``client_body``)."""

    field: str  # "prompt": more words than max_model_len; "max_tokens": max_model_len + 1


@dataclass(frozen=True)
class Limits:
    """What bodies are sized from: D's context length and the sidecars' body cap."""

    max_model_len: int = 256

    @property
    def body_cap(self) -> int:
        """The sidecars' ``--max-body-bytes``: room for a prompt over the context, no more."""
        return max(65536, 8 * self.max_model_len + 4096)


_TOO_LONG, _TOO_MANY = OverContext("prompt"), OverContext("max_tokens")

SIDECAR_SCENARIOS: tuple[Scenario, ...] = (
    Scenario("admit", "completion", ADMITTED, COMPLETIONS, Expect.D_READS, long_prompt=True),
    Scenario("admit-chat", "chat completion", ADMITTED, CHAT, Expect.D_READS, long_prompt=True),
    Scenario(
        "admit-stream",
        "completion, stream",
        ADMITTED,
        COMPLETIONS,
        Expect.D_READS,
        stream=True,
        long_prompt=True,
    ),
    Scenario("admit-responses", "responses", ADMITTED, RESPONSES, Expect.D_READS, long_prompt=True),
    Scenario(
        "pre-validation", "max_tokens 'abc'", PRE, COMPLETIONS, Expect.SIDECAR_FREES, {"max_tokens": "abc"}
    ),
    Scenario(
        "pre-validation-stream",
        "max_tokens 'abc', stream",
        PRE,
        COMPLETIONS,
        Expect.SIDECAR_FREES,
        {"max_tokens": "abc"},
        stream=True,
    ),
    Scenario(
        "pre-content-type",
        "content-type text/plain",
        PRE,
        COMPLETIONS,
        Expect.SIDECAR_FREES,
        content_type="text/plain",
    ),
    Scenario(
        "pre-chat-validation",
        "chat, max_tokens 'abc'",
        PRE,
        CHAT,
        Expect.SIDECAR_FREES,
        {"max_tokens": "abc"},
    ),
    Scenario(
        "pre-responses-validation",
        "responses, max_output_tokens 'abc', stream",
        PRE,
        RESPONSES,
        Expect.SIDECAR_FREES,
        {"max_output_tokens": "abc"},
        stream=True,
    ),
    Scenario(
        "cap", "body over the sidecar's cap (413)", CAP, COMPLETIONS, Expect.SIDECAR_FREES, oversize=True
    ),
    Scenario(
        "stream-dp-rank",
        "x-data-parallel-rank 5, stream (200, error event)",
        AFTER_200,
        COMPLETIONS,
        Expect.SIDECAR_FREES,
        stream=True,
        headers=(("x-data-parallel-rank", "5"),),
    ),
    Scenario(
        "handler-temperature", "temperature -1", HANDLER, COMPLETIONS, Expect.D_FREES, {"temperature": -1}
    ),
    Scenario(
        "handler-temperature-stream",
        "temperature -1, stream",
        HANDLER,
        COMPLETIONS,
        Expect.D_FREES,
        {"temperature": -1},
        stream=True,
    ),
    Scenario(
        "handler-model",
        "unknown model (404)",
        HANDLER,
        COMPLETIONS,
        Expect.D_FREES,
        {"model": "no-such-model"},
        status=404,
    ),
    Scenario(
        "handler-too-long",
        "prompt over max_model_len",
        HANDLER,
        COMPLETIONS,
        Expect.D_FREES,
        {"prompt": _TOO_LONG},
    ),
    Scenario(
        "handler-max-tokens",
        "max_tokens over max_model_len",
        HANDLER,
        COMPLETIONS,
        Expect.D_FREES,
        {"max_tokens": _TOO_MANY},
    ),
    Scenario("handler-top-p", "top_p 0", HANDLER, COMPLETIONS, Expect.D_FREES, {"top_p": 0}),
    Scenario(
        "handler-dp-rank",
        "x-data-parallel-rank 5",
        HANDLER,
        COMPLETIONS,
        Expect.D_FREES,
        headers=(("x-data-parallel-rank", "5"),),
    ),
    Scenario(
        "handler-chat-temperature", "chat, temperature -1", HANDLER, CHAT, Expect.D_FREES, {"temperature": -1}
    ),
    Scenario(
        "handler-responses-temperature",
        "responses, temperature -1",
        HANDLER,
        RESPONSES,
        Expect.D_FREES,
        {"temperature": -1},
    ),
    Scenario(
        "handler-responses-temperature-stream",
        "responses, temperature -1, stream",
        HANDLER,
        RESPONSES,
        Expect.D_FREES,
        {"temperature": -1},
        stream=True,
    ),
    Scenario("admit-messages", "messages (Anthropic)", ADMITTED, MESSAGES, Expect.D_READS, long_prompt=True),
    Scenario(
        "pre-messages-validation",
        "messages, max_tokens 'abc'",
        PRE,
        MESSAGES,
        Expect.SIDECAR_FREES,
        {"max_tokens": "abc"},
    ),
    Scenario(
        "pre-generate-validation",
        "token-in generate, stream 'abc' (no cleanup on that route in D)",
        PRE,
        GENERATE,
        Expect.SIDECAR_FREES,
        {"stream": "abc"},
    ),
    Scenario("down", "D stopped", DOWN, COMPLETIONS, Expect.SIDECAR_FREES, d_down=True),
    Scenario(
        "down-stream", "D stopped, stream", DOWN, COMPLETIONS, Expect.SIDECAR_FREES, stream=True, d_down=True
    ),
)

_BY_KEY = {s.key: s for s in SIDECAR_SCENARIOS}
#: Router mode: the sidecar's scenarios that apply to it, then its own, D down last.
ROUTER_SCENARIOS: tuple[Scenario, ...] = (
    *(
        _BY_KEY[key]
        for key in ("admit", "admit-chat", "admit-stream", "pre-validation", "pre-validation-stream")
    ),
    _BY_KEY["handler-max-tokens"],
    Scenario(
        "handler-max-tokens-stream",
        "max_tokens over max_model_len, stream",
        HANDLER,
        COMPLETIONS,
        Expect.D_FREES,
        {"max_tokens": _TOO_MANY},
        stream=True,
    ),
    Scenario("cap", "body over the router's cap (413)", CAP, COMPLETIONS, Expect.NOT_PINNED, oversize=True),
    *(_BY_KEY[key] for key in ("admit-messages", "pre-messages-validation", "pre-generate-validation")),
    _BY_KEY["down"],
)

#: vllm-router in front (tests.e2e.vllmrouter): what its P/D mode sends D, judged as the other modes.
STREAM_OPTIONS = Scenario(
    "pre-stream-options",
    "stream_options without stream (the router drops it from P's leg only)",
    PRE,
    COMPLETIONS,
    Expect.SIDECAR_FREES,
    {"stream_options": {"include_usage": True}},
)
VLLM_ROUTER_SCENARIOS: tuple[Scenario, ...] = (
    *(_BY_KEY[key] for key in ("admit", "admit-chat", "admit-stream")),
    STREAM_OPTIONS,
    _BY_KEY["handler-max-tokens"],
    _BY_KEY["down"],
)
#: Its control: the same refusal through vllm-router with no sidecar, held until P's lease.
VLLM_ROUTER_CONTROL = STREAM_OPTIONS

#: smg in front (tests.e2e.smg), its D requiring an API key that every other request carries: a
#: request without it is refused by D (401, before its handler) and, not streamed, retried by smg as
#: a whole pair, five prefills in all (its --retry-max-retries), the client then getting smg's 500.
SMG_RETRIES = 5
NO_KEY = Scenario(
    "pre-no-key",
    "no API key for D: 401, smg retries the pair",
    PRE,
    COMPLETIONS,
    Expect.SIDECAR_FREES,
    keyless=True,
    status=500,
    prefills=SMG_RETRIES,
)
SMG_SCENARIOS: tuple[Scenario, ...] = (
    *(_BY_KEY[key] for key in ("admit", "admit-chat", "admit-stream")),
    NO_KEY,
    Scenario(
        "pre-no-key-stream",
        "no API key, stream: 401, not retried",
        PRE,
        COMPLETIONS,
        Expect.SIDECAR_FREES,
        stream=True,
        keyless=True,
        status=401,
    ),
)
#: Its control: the same refusal through smg straight to D, every retried prefill held until the lease.
SMG_CONTROL = NO_KEY

#: The negative control: the sidecar with releases off, on a rejection only the sidecar can free.
CONTROL = _BY_KEY["pre-validation"]
#: A few scenarios per mode for a short run (``--reduced``): together every group of the full
#: table (admitted, before D's handler, the body cap, a stream rejected after its 200, D's
#: handler, D down), each route (completions, chat, responses, Anthropic's messages, the
#: token-in generate route; streams) and each strategy. The two routes llm-d added run in router
#: mode, where the sidecar writes both legs (the generate route's caps inside sampling_params).
REDUCED: dict[Mode, frozenset[str]] = {
    "nixl": frozenset(
        {"admit-stream", "admit-chat", "admit-responses", "pre-validation", "cap", "stream-dp-rank"}
        | {"handler-temperature", "down"}
    ),
    "http": frozenset({"admit", "pre-responses-validation", "stream-dp-rank", "handler-chat-temperature"}),
    "router": frozenset(
        {"admit", "pre-validation-stream", "handler-max-tokens", "cap", "down"}
        | {"admit-messages", "pre-generate-validation"}
    ),
    "auto": frozenset(
        {"admit", "pre-chat-validation", "stream-dp-rank", "handler-responses-temperature-stream", "down"}
    ),
    "defaults": frozenset({"admit-chat", "pre-validation", "stream-dp-rank", "handler-temperature", "down"}),
}


def scenarios_for(mode: Mode, reduced: bool = False) -> tuple[Scenario, ...]:
    """The scenarios of ``mode`` (D-down ones last: D stays stopped after them). The shipped
    defaults' body cap is 64 MiB: no cap scenario there."""
    if mode == "off":
        return (CONTROL,)
    if mode == "vllm-router-bare":
        return (VLLM_ROUTER_CONTROL,)
    if mode == "vllm-router":  # a few already: the reduced run takes them all
        return VLLM_ROUTER_SCENARIOS
    if mode == "smg-bare":
        return (SMG_CONTROL,)
    if mode == "smg":
        return SMG_SCENARIOS
    chosen = ROUTER_SCENARIOS if mode == "router" else SIDECAR_SCENARIOS
    if mode == "defaults":
        chosen = tuple(s for s in chosen if not s.oversize)
    return tuple(s for s in chosen if not reduced or s.key in REDUCED[mode])


def prompt(key: str, words: int) -> str:
    """A made-up prompt of ``words`` words, the same for the same ``key`` in every run."""
    rng = random.Random(key)
    return " ".join("".join(rng.choice(WORDS) for _ in range(rng.randint(1, 3))) for _ in range(words))


def base_body(route: str, model: str, text: str, detail: bool = False) -> dict[str, Any]:
    """The valid, greedy request of ``route`` for ``text``; with ``detail``, asking for each
    generated token and its logprob as well (``tests.e2e.answers``: what an answer is compared on)."""
    if route == CHAT:
        body = {
            "model": model,
            "messages": [{"role": "user", "content": text}],
            "max_tokens": OUTPUT_TOKENS,
            "temperature": 0,
            "ignore_eos": True,
        }
        return {**body, **DETAIL[CHAT]} if detail else body
    if route == RESPONSES:
        body = {"model": model, "input": text, "max_output_tokens": OUTPUT_TOKENS, "temperature": 0}
        return {**body, **DETAIL[RESPONSES]} if detail else body
    if route == MESSAGES:
        return {
            "model": model,
            "messages": [{"role": "user", "content": text}],
            "max_tokens": OUTPUT_TOKENS,
            "temperature": 0,
        }
    if route == GENERATE:
        sampling = {"max_tokens": OUTPUT_TOKENS, "temperature": 0, "ignore_eos": True}
        return {"model": model, "token_ids": token_ids(text), "sampling_params": sampling}
    body = {
        "model": model,
        "prompt": text,
        "max_tokens": OUTPUT_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,  # vLLM's own field: the answer lists the token ids
    }
    return {**body, **DETAIL[COMPLETIONS]} if detail else body


#: What an admitted request asks for beside the text, by route (vLLM's fields).
DETAIL: dict[str, dict[str, Any]] = {
    COMPLETIONS: {"logprobs": 1},
    CHAT: {"logprobs": True, "return_token_ids": True},
    RESPONSES: {"include": ["message.output_text.logprobs"], "top_logprobs": 1},
}


def token_ids(text: str) -> list[int]:
    """Token ids for the token-in route: one per word, the same for the same word, within the
    e2e model's vocabulary (1,024 tokens, ``make_model.VOCAB``): ids 10 to 1009."""
    return [10 + int.from_bytes(word.encode()[:8].ljust(8, b"\0"), "big") % 1000 for word in text.split()]


def pin_body(scenario: Scenario, model: str, text: str) -> bytes:
    """The prefill leg P gets for ``scenario`` (the route's valid body, one output token)."""
    return prefill_body(base_body(scenario.route, model, text), scenario.route)


def client_body(scenario: Scenario, model: str, text: str, limits: Limits) -> dict[str, Any]:
    """What the client sends: the base body, the fault (sized from ``limits``), the stream flag,
    and for an oversized scenario padding past the body cap."""
    body = base_body(scenario.route, model, text, detail=scenario.expect is Expect.D_READS)
    for name, value in scenario.change.items():
        body[name] = _sized(value, limits) if isinstance(value, OverContext) else value
    if scenario.stream:
        body["stream"] = True
    if scenario.oversize:
        body["user"] = "x" * (limits.body_cap + 4096)
    return body


def _sized(value: OverContext, limits: Limits) -> str | int:
    if value.field == "prompt":
        return " ".join(["kalo"] * (limits.max_model_len + 8))  # one token a word at least
    return limits.max_model_len + 1


def decode_leg(body: dict[str, Any], params: dict[str, Any]) -> bytes:
    """The decode leg as a router sends it: the body with P's parameters as the last member."""
    return json.dumps({**body, "kv_transfer_params": params}).encode()


def headers_for(scenario: Scenario, request_id: str) -> dict[str, str]:
    """The request's headers: content type, ``x-request-id`` and the scenario's own."""
    return {"content-type": scenario.content_type, "x-request-id": request_id, **dict(scenario.headers)}
