"""One P->D flow, as vLLM's reference proxy runs it, timed and classified.

The prefill leg goes to P (``prefill_body``); P's answer carries the
``kv_transfer_params`` D needs. The decode leg then goes to D (or the
sidecar) with the client's body plus those parameters and the same
``x-request-id``. ``FlowResult`` records what happened: P's status and the
id and number of blocks P pinned, D's status and error type, an in-band
stream error, time to first token (from the start of the prefill leg) and
total time. Transport errors are caught here and recorded, never raised.
"""

from __future__ import annotations

import time
from typing import Any, Literal

import aiohttp
import msgspec

from sidecar.loadtest.workload import Plan, decode_body, prefill_body

Outcome = Literal["ok", "p_refused", "p_failed", "rejected", "stream_rejected", "incomplete", "error"]
REJECTED = ("rejected", "stream_rejected")
_DECODER = msgspec.json.Decoder()
_ENCODER = msgspec.json.Encoder()
_JSON = {"content-type": "application/json"}


class FlowResult(msgspec.Struct, kw_only=True):
    """What happened to one flow; ``start`` is seconds since the run began."""

    index: int
    request_id: str
    kind: str
    stream: bool
    prompt_words: int
    start: float
    outcome: Outcome = "error"
    prefill_status: int = 0
    prefill_seconds: float = 0.0
    p_request_id: str | None = None  # the id P pinned the blocks under
    blocks: int = 0  # blocks P pinned for D
    decode_status: int = 0
    error_type: str | None = None  # error.type of the decode leg's error answer
    stream_error: int | None = None  # code of an error event that opened a 200 stream
    injected: bool = False  # the sidecar injected this rejection itself
    ttft: float | None = None
    total: float = 0.0
    tokens: int = 0
    detail: str = ""


def p_internal_id(params: dict[str, Any], path: str, request_id: str) -> str:
    """The id P holds the blocks under: ``remote_request_id`` (vLLM 0.13.0+), else vLLM's
    own derivation from the x-request-id."""
    rid = params.get("remote_request_id")
    if isinstance(rid, str) and rid:
        return rid
    return f"chatcmpl-{request_id}" if path.endswith("/chat/completions") else f"cmpl-{request_id}-0"


def count_blocks(block_ids: Any) -> int:
    """Blocks in ``remote_block_ids``: a flat list, or one list per KV cache group."""
    if not isinstance(block_ids, list) or not block_ids:
        return 0
    if all(isinstance(group, list) for group in block_ids):
        return max(len(group) for group in block_ids)
    return len(block_ids)


def error_info(body: bytes) -> tuple[str | None, str]:
    """(``error.type``, message) of an error body: vLLM's nested or flat shape, or a
    middleware's ``{"error": "..."}``/``{"detail": ...}`` (no type)."""
    try:
        data = _DECODER.decode(body)
    except msgspec.DecodeError:
        return None, body[:200].decode(errors="replace")
    if not isinstance(data, dict):
        return None, str(data)[:200]
    error = data.get("error", data)
    if isinstance(error, dict):
        kind = error.get("type")
        return (kind if isinstance(kind, str) else None), str(error.get("message", ""))[:200]
    return None, str(error if "error" in data else data.get("detail", ""))[:200]


async def run_flow(session: aiohttp.ClientSession, plan: Plan, prefill_url: str, t0: float) -> FlowResult:
    """Run both legs of ``plan``; ``t0`` is the run's ``time.monotonic()`` origin."""
    started = time.monotonic()
    result = FlowResult(
        index=plan.index,
        request_id=plan.request_id,
        kind=plan.kind,
        stream=plan.stream,
        prompt_words=plan.prompt_words,
        start=started - t0,
    )
    try:
        params = await _prefill(session, plan, prefill_url, result)
        if params is not None:
            await _decode(session, plan, params, result, started)
    except (TimeoutError, aiohttp.ClientError, OSError, msgspec.DecodeError, ValueError) as exc:
        result.outcome = "incomplete" if result.decode_status == 200 else "error"
        result.detail = f"{type(exc).__name__}: {exc}"[:200]
    result.total = time.monotonic() - started
    return result


async def _prefill(
    session: aiohttp.ClientSession, plan: Plan, prefill_url: str, result: FlowResult
) -> dict[str, Any] | None:
    route = "chat" if plan.path.endswith("/chat/completions") else "completions"
    headers = {"x-request-id": plan.request_id, **_JSON, **plan.prefill_headers}
    data = _ENCODER.encode(prefill_body(plan.body, route))
    started = time.monotonic()
    async with session.post(prefill_url + plan.path, data=data, headers=headers) as r:
        result.prefill_status = r.status
        body = await r.read()
    result.prefill_seconds = time.monotonic() - started
    if r.status != 200:
        result.outcome = "p_refused" if r.status == 503 else "p_failed"
        result.error_type, result.detail = error_info(body)
        return None
    data = _DECODER.decode(body)
    params = data.get("kv_transfer_params") if isinstance(data, dict) else None
    if not isinstance(params, dict) or not params.get("do_remote_prefill"):
        result.outcome, result.detail = "p_failed", "P answered without kv_transfer_params"
        return None
    result.p_request_id = p_internal_id(params, plan.path, plan.request_id)
    result.blocks = count_blocks(params.get("remote_block_ids"))
    return params


async def _decode(
    session: aiohttp.ClientSession,
    plan: Plan,
    params: dict[str, Any],
    result: FlowResult,
    started: float,
) -> None:
    headers = {"x-request-id": plan.request_id, **_JSON, **plan.decode_headers}
    data = _ENCODER.encode(decode_body(plan.body, params))
    async with session.post(plan.decode_url + plan.path, data=data, headers=headers) as response:
        result.decode_status = response.status
        result.injected = response.headers.get("x-kvr-injected") == "true"
        if response.status != 200:
            result.outcome = "rejected"
            result.error_type, result.detail = error_info(await response.read())
        elif plan.stream:
            await _read_stream(response, result, started)
        else:
            _read_full(await response.read(), result)
            result.ttft = time.monotonic() - started


def _read_full(body: bytes, result: FlowResult) -> None:
    data = _DECODER.decode(body)
    choices = data.get("choices") if isinstance(data, dict) else None
    choice = choices[0] if isinstance(choices, list) and choices else {}
    text = choice.get("text") or (choice.get("message") or {}).get("content") or ""
    result.tokens = len(str(text).split())
    finished = bool(choice.get("finish_reason")) and result.tokens > 0
    result.outcome = "ok" if finished else "incomplete"
    if not finished:
        result.detail = "200 without a finished completion"


async def _read_stream(response: aiohttp.ClientResponse, result: FlowResult, started: float) -> None:
    finished = done = False
    async for raw in response.content:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        payload = line[5:].strip()
        if payload == b"[DONE]":
            done = True
            break
        event = _DECODER.decode(payload)
        if isinstance(event, dict) and "error" in event:
            error = event["error"] if isinstance(event["error"], dict) else {}
            code = error.get("code")
            if result.tokens == 0 and result.ttft is None:
                result.outcome, result.stream_error = "stream_rejected", code if isinstance(code, int) else 0
                result.error_type, result.detail = error.get("type"), str(error.get("message", ""))[:200]
                return
            result.outcome, result.detail = "incomplete", f"error event after tokens: {error}"[:200]
            return
        choices = event.get("choices") if isinstance(event, dict) else None
        for choice in choices if isinstance(choices, list) else ():
            text = choice.get("text") or (choice.get("delta") or {}).get("content")
            if text:
                result.tokens += 1
                if result.ttft is None:
                    result.ttft = time.monotonic() - started
            finished = finished or bool(choice.get("finish_reason"))
    result.outcome = "ok" if finished and done and result.tokens else "incomplete"
    if result.outcome == "incomplete":
        result.detail = f"stream ended early (finish_reason seen: {finished}, [DONE] seen: {done})"
