"""What the model wrote in an answer (JSON or SSE), and how a P/D answer differs from D's own.

Every admitted request asks for what its route can return beside the text
(``tests.e2e.scenarios.base_body``): completions the token ids
(``return_token_ids``) and each token's logprob (``logprobs: 1``), chat the
token ids and logprobs (``logprobs: true``), ``/v1/responses`` each token
and its logprob (``include: ["message.output_text.logprobs"]``). ``Output``
holds them; ``differences`` compares a P/D answer with D's answer to the
same prompt: the same text, the same tokens, and each token's logprob within
``TOLERANCE``. Reading the wrong blocks moves logprobs by far more (the
model's own figures: ``docs/dev/testing.md``), even when a greedy token happens
to be the same.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

#: The largest difference in a token's logprob between a P/D answer and D's own that counts as
#: the same computation (the P/D path computes the prompt on P and the last token on D).
TOLERANCE = 0.02


@dataclass(frozen=True)
class Output:
    """The generated text, token ids (where the route returns them), tokens and their logprobs."""

    text: str = ""
    ids: tuple[int, ...] = ()
    tokens: tuple[str, ...] = ()
    logprobs: tuple[float, ...] = ()

    def summary(self) -> str:
        """The text, then the ids or tokens, for the report."""
        listed = f" | tokens {list(self.ids)}" if self.ids else ""
        if self.logprobs:
            listed += f" | logprobs {[round(value, 3) for value in self.logprobs[:4]]}"
        return self.text + listed


def output_of(route: str, raw: bytes) -> Output:
    """The ``Output`` of an answer of ``route`` (an empty one when nothing can be read)."""
    text = raw.decode(errors="replace").strip()
    if text.startswith("data:") or text.startswith("event:"):
        return _joined([_piece(route, payload) for payload in _events(text)])
    try:
        payload = json.loads(text)
    except ValueError:
        return Output()
    return _joined([_piece(route, payload)])


def differences(pd: Output, reference: Output, tolerance: float = TOLERANCE) -> list[str]:
    """How the P/D answer differs from D's own; empty when they are the same."""
    found = []
    if not pd.text and not pd.ids:
        found.append("the P/D answer has no output")
    for name in ("text", "ids", "tokens"):
        if getattr(pd, name) != getattr(reference, name):
            found.append(f"{name}: {getattr(pd, name)!r} vs D's own {getattr(reference, name)!r}")
    if len(pd.logprobs) != len(reference.logprobs):
        found.append(f"logprobs: {len(pd.logprobs)} vs D's own {len(reference.logprobs)}")
    gap = logprob_gap(pd, reference)
    if gap is not None and gap > tolerance:
        found.append(f"logprobs differ by up to {gap:.4f} (tolerance {tolerance})")
    return found


def logprob_gap(pd: Output, reference: Output) -> float | None:
    """The largest difference between the two answers' logprobs, token by token (None: none)."""
    pairs = list(zip(pd.logprobs, reference.logprobs, strict=False))
    return max((abs(a - b) for a, b in pairs), default=None)


def _events(text: str) -> list[Any]:
    payloads = []
    for line in text.splitlines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data and data != "[DONE]":
            try:
                payloads.append(json.loads(data))
            except ValueError:
                continue
    return payloads


def _piece(route: str, payload: Any) -> Output:
    if not isinstance(payload, dict):
        return Output()
    if route.endswith("/responses"):
        return _responses(payload)
    if route.endswith("/messages"):
        return Output(_messages_text(payload))  # Anthropic's API returns no token ids or logprobs
    text, ids, tokens, logprobs = "", list[int](), list[str](), list[float]()
    for choice in payload.get("choices") or []:
        message = choice.get("message") or choice.get("delta") or {}
        text += choice.get("text") or message.get("content") or ""
        ids += choice.get("token_ids") or []
        found = choice.get("logprobs") or {}
        if isinstance(found.get("content"), list):  # chat: one entry per token
            tokens += [str(entry.get("token")) for entry in found["content"]]
            logprobs += [float(entry.get("logprob")) for entry in found["content"]]
        else:  # completions: parallel lists
            tokens += [str(token) for token in found.get("tokens") or []]
            logprobs += [float(value) for value in found.get("token_logprobs") or []]
    return Output(text, tuple(ids), tuple(tokens), tuple(logprobs))


def _responses(payload: dict[str, Any]) -> Output:
    if payload.get("type") == "response.output_text.delta":
        return Output(str(payload.get("delta") or ""), (), *_token_logprobs(payload.get("logprobs")))
    if "type" in payload:  # other stream events: the text arrives in deltas
        return Output()
    text, tokens, logprobs = "", list[str](), list[float]()
    for item in payload.get("output") or []:
        for content in item.get("content") or []:
            if content.get("type") == "output_text":
                text += content.get("text") or ""
                more_tokens, more_logprobs = _token_logprobs(content.get("logprobs"))
                tokens += more_tokens
                logprobs += more_logprobs
    return Output(text, (), tuple(tokens), tuple(logprobs))


def _messages_text(payload: dict[str, Any]) -> str:
    """Anthropic's shape: a message's text blocks, or a stream's text deltas."""
    delta = payload.get("delta")
    if isinstance(delta, dict) and delta.get("type") == "text_delta":
        return str(delta.get("text") or "")
    if payload.get("type") != "message":
        return ""
    return "".join(
        str(block.get("text") or "") for block in payload.get("content") or [] if block.get("type") == "text"
    )


def _token_logprobs(entries: Any) -> tuple[tuple[str, ...], tuple[float, ...]]:
    if not isinstance(entries, list):
        return (), ()
    return (
        tuple(str(entry.get("token")) for entry in entries),
        tuple(float(entry.get("logprob")) for entry in entries),
    )


def _joined(parts: list[Output]) -> Output:
    return Output(
        "".join(part.text for part in parts),
        tuple(token for part in parts for token in part.ids),
        tuple(token for part in parts for token in part.tokens),
        tuple(value for part in parts for value in part.logprobs),
    )
