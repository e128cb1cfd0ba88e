"""The decode simulator's Responses API answers, shaped like vLLM 0.33.0's.

vLLM's ``ResponsesResponse`` carries the sampling settings it used besides
the output; its stream (``responses_stream_generator`` with the simple,
non-harmony processor) is ``response.created``, ``response.in_progress``,
``response.output_item.added`` (an empty assistant message),
``response.content_part.added`` (an empty ``output_text`` part), one
``response.output_text.delta`` per token, then ``response.output_text.done``,
``response.content_part.done``, ``response.output_item.done`` and
``response.completed`` (``response.incomplete`` when the output budget cut
the answer). Every event is ``event: <type>`` plus its JSON, with
``sequence_number`` counting from 0; the stream has no ``[DONE]``. Fields are
in the order vLLM's pydantic models dump them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

_ENCODER = msgspec.json.Encoder()


@dataclass(frozen=True, slots=True)
class Reply:
    """What one answer says: who asked, how long the prompt was, how much is generated."""

    route: str
    request_id: str
    created: int
    prompt_tokens: int
    tokens: int  # generated tokens (the simulator's answer, cut by the output budget)
    finished: bool  # True: the answer ended by itself ("stop"); False: the budget cut it ("length")
    cached_tokens: int = 0  # a vLLM D counts the tokens it received from P as cached
    include_usage: bool = False
    max_tokens: int = 0  # the sampling budget vLLM used (Responses report it)
    temperature: float | None = None
    top_p: float | None = None
    aborted: bool = False  # a shutting-down engine dropped the request: no tokens, "abort"

    @property
    def finish_reason(self) -> str:
        return "abort" if self.aborted else "stop" if self.finished else "length"


def _message(reply: Reply, parts: list[dict[str, Any]], status: str) -> dict[str, Any]:
    return {
        "id": f"msg_{reply.request_id}",
        "content": parts,
        "role": "assistant",
        "status": status,
        "type": "message",
    }


def _part(text: str, logprobs: list[Any] | None) -> dict[str, Any]:
    return {"annotations": [], "text": text, "type": "output_text", "logprobs": logprobs}


def _usage(reply: Reply) -> dict[str, Any]:
    return {
        "input_tokens": reply.prompt_tokens,
        "input_tokens_details": {
            "cached_tokens": reply.cached_tokens,
            "input_tokens_per_turn": [],
            "cached_tokens_per_turn": [],
        },
        "output_tokens": reply.tokens,
        "output_tokens_details": {
            "reasoning_tokens": 0,
            "tool_output_tokens": 0,
            "output_tokens_per_turn": [],
            "tool_output_tokens_per_turn": [],
        },
        "total_tokens": reply.prompt_tokens + reply.tokens,
    }


def response(reply: Reply, model: str, text: str | None) -> dict[str, Any]:
    """vLLM's ``ResponsesResponse``: in progress (``text`` None) or finished."""
    done = text is not None
    status = "in_progress" if not done else "completed" if reply.finished else "incomplete"
    output = [_message(reply, [_part(text, None)], status)] if text is not None else []
    return {
        "id": f"resp_{reply.request_id}",
        "created_at": reply.created,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": None,
        "metadata": None,
        "model": model,
        "object": "response",
        "output": output,
        "parallel_tool_calls": True,
        "temperature": 1.0 if reply.temperature is None else reply.temperature,
        "tool_choice": "auto",
        "tools": [],
        "top_p": 1.0 if reply.top_p is None else reply.top_p,
        "background": False,
        "max_output_tokens": reply.max_tokens,
        "max_tool_calls": None,
        "previous_response_id": None,
        "prompt": None,
        "prompt_cache_options": None,
        "prompt_cache_key": None,
        "prompt_cache_retention": None,
        "reasoning": None,
        "safety_identifier": None,
        "service_tier": "auto",
        "status": status,
        "text": None,
        "top_logprobs": None,
        "truncation": "disabled",
        "usage": _usage(reply) if done else None,
        "user": None,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "kv_transfer_params": None,
        "ec_transfer_params": None,
        "input_messages": None,
        "output_messages": None,
    }


_SEQ = "sequence_number"


class ResponseEvents:
    """Numbers and encodes the events of one streamed answer. Each event's fields are given in
    vLLM's order, ``sequence_number`` included (its value is set here); ``type`` comes last."""

    def __init__(self) -> None:
        self.events: list[bytes] = []

    def add(self, type_: str, fields: dict[str, Any]) -> None:
        data = _ENCODER.encode({**fields, _SEQ: len(self.events), "type": type_})
        self.events.append(b"event: " + type_.encode() + b"\ndata: " + data + b"\n\n")


def stream(reply: Reply, model: str, deltas: list[str]) -> list[bytes]:
    """Every event of a streamed answer made of ``deltas`` (see the module docstring)."""
    started = response(reply, model, None)
    text = "".join(deltas)
    item_id = f"msg_{reply.request_id}"
    final = response(reply, model, text)
    events = ResponseEvents()
    events.add("response.created", {"response": started, _SEQ: 0})
    events.add("response.in_progress", {"response": started, _SEQ: 0})
    item = _message(reply, [], "in_progress")
    events.add("response.output_item.added", {"item": item, "output_index": 0, _SEQ: 0})
    at = {"content_index": 0, "item_id": item_id, "output_index": 0}
    events.add("response.content_part.added", {**at, "part": _part("", []), _SEQ: 0})
    for delta in deltas:
        fields = {"content_index": 0, "delta": delta, "item_id": item_id, "logprobs": [], "output_index": 0}
        events.add("response.output_text.delta", {**fields, _SEQ: 0})
    done = {"content_index": 0, "item_id": item_id, "logprobs": [], "output_index": 0, _SEQ: 0, "text": text}
    events.add("response.output_text.done", done)
    events.add("response.content_part.done", {**at, "part": _part(text, None), _SEQ: 0})
    events.add("response.output_item.done", {"item": final["output"][0], "output_index": 0, _SEQ: 0})
    terminal = "response.completed" if reply.finished else "response.incomplete"
    events.add(terminal, {"response": final, _SEQ: 0})
    return events.events
