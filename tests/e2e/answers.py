"""The generated text (and token ids, where vLLM returns them) of an answer, JSON or SSE."""

from __future__ import annotations

import json
from typing import Any


def text_of(route: str, raw: bytes) -> str:
    """What the model wrote: the text, then `` | tokens [...]`` when the answer lists token ids."""
    text = raw.decode(errors="replace").strip()
    if text.startswith("data:") or text.startswith("event:"):
        parts = [_piece(route, payload) for payload in _events(text)]
        return _joined(parts)
    try:
        payload = json.loads(text)
    except ValueError:
        return ""
    return _joined([_piece(route, payload)])


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


def _piece(route: str, payload: Any) -> tuple[str, list[int]]:
    if not isinstance(payload, dict):
        return "", []
    if route.endswith("/responses"):
        return _responses_text(payload), []
    if route.endswith("/messages"):
        return _messages_text(payload), []
    text, ids = "", list[int]()
    for choice in payload.get("choices") or []:
        message = choice.get("message") or choice.get("delta") or {}
        text += choice.get("text") or message.get("content") or ""
        ids += choice.get("token_ids") or []
    return text, ids


def _responses_text(payload: dict[str, Any]) -> str:
    if payload.get("type") == "response.output_text.delta":
        return str(payload.get("delta") or "")
    if "type" in payload:  # other stream events: the text arrives in deltas
        return ""
    text = ""
    for item in payload.get("output") or []:
        for content in item.get("content") or []:
            if content.get("type") == "output_text":
                text += content.get("text") or ""
    return text


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


def _joined(parts: list[tuple[str, list[int]]]) -> str:
    text = "".join(part for part, _ in parts)
    ids = [token for _, tokens in parts for token in tokens]
    return f"{text} | tokens {ids}" if ids else text
