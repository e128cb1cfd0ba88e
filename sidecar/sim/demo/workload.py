"""The demo's traffic: ordinary P->D requests mixed with ones D rejects for realistic reasons.

Each rejection kind is one a production D sees: a prompt over D's
``max_model_len``, a model D does not serve, a field D's request validation
refuses (the prefill leg drops ``stream_options``, so P never sees it), an
expired API key (P checks none), a stream whose engine admission fails
after HTTP 200, and a D that is down. Some ordinary requests take long to
decode, so D's admission control (``max_concurrency``) refuses others with
503 when they pile up. ``cause_of`` names a rejection from what was
measured (status, ``error.type``, where D's log says it refused), and
``freed_without_sidecar`` says who frees P's blocks for it when there is no
sidecar: D itself for rejections its completion handler raises, from vLLM
0.21.0 (``notify_kv_transfer_request_rejected``), and otherwise only P's
lease.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from typing import Any

from sidecar.loadtest.workload import Body, Kind, Workload
from sidecar.sim.prefill.release import parse_version

API_KEY = "demo-key"
FIX_RELEASE = (0, 21, 0)  # D frees its own handler rejections from this release on
STREAM_ADMISSION = "stream admission failure (200 + error event)"
D_DOWN = "D down (the sidecar answers 503)"
#: (status, error.type) of D's answers -> the cause they show.
CAUSES: dict[tuple[int, str | None], str] = {
    (401, None): "expired API key (401, auth middleware)",
    (400, "Bad Request"): "invalid field (400, request validation)",
    (400, "BadRequestError"): "prompt over max_model_len (400, handler)",
    (404, "NotFoundError"): "unknown model (404, handler)",
    (503, "Service Unavailable"): "overloaded (503, admission control)",
}


def _append_to_prompt(marker: str) -> Callable[[Body, random.Random], Body]:
    def edit(body: Body, rng: random.Random) -> Body:
        if "messages" in body:
            message = body["messages"][0]
            return {**body, "messages": [{**message, "content": f"{message['content']} {marker}"}]}
        return {**body, "prompt": f"{body['prompt']} {marker}"}

    return edit


def _set(field: str, value: Any) -> Callable[[Body, random.Random], Body]:
    def edit(body: Body, rng: random.Random) -> Body:
        return {**body, field: value}

    return edit


def demo_workload(down_url: str, max_model_len: int) -> Workload:
    """The demo's mix; ``down_url`` is a sidecar whose D is down."""
    return Workload(
        [
            Kind("plain", 0.58),
            # Long generations: D answers after 0.3 s, so bursts exceed its admission limit.
            Kind("long decode", 0.10, edit=_append_to_prompt("[[slow-headers:0.3]]")),
            Kind("prompt too long", 0.06, words=lambda rng: max_model_len + rng.randint(1, 48)),
            Kind("unknown model", 0.05, edit=_set("model", "llama-3-70b-instruct")),
            Kind("invalid field", 0.05, edit=_set("stream_options", "include_usage")),
            Kind("expired API key", 0.05, decode_headers={"Authorization": "Bearer expired-key"}),
            Kind("stream admission", 0.06, edit=_append_to_prompt("[[stream-error:400]]"), stream=True),
            Kind("D down", 0.05, decode_url=down_url),
        ]
    )


def cause_of(flow: Mapping[str, Any]) -> str:
    """The measured cause of a rejected flow (a ``report`` flow record)."""
    if flow["outcome"] == "stream_rejected":
        return STREAM_ADMISSION
    if flow.get("d_origin") is None and flow["decode_status"] == 503:
        return D_DOWN
    found = CAUSES.get((flow["decode_status"], flow["error_type"]))
    return found or f"other ({flow['decode_status']} {flow['error_type']})"


def freed_without_sidecar(origin: str | None, version: str) -> str:
    """Who frees P's blocks for a rejection D refused at ``origin`` when nothing else does."""
    if origin == "handler" and parse_version(version) >= FIX_RELEASE:
        return "D itself (0.21.0+ fix)"
    return "nobody: P's lease"
