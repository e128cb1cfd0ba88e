"""The control endpoint's routes and bodies, shared by the plugin (in D) and the ``http`` strategy.

One version of the API, ``v1``, under ``/kv_release/``: outside the
prefixes vLLM's own ``--api-key`` middleware guards (``/v1``, ``/v2``,
``/inference``, ``/cohere``), so the plugin's token is the only check. Bodies
evolve by appending fields with defaults; unknown fields are ignored on both
sides, so an older plugin and a newer sidecar (or the reverse) still agree.
Decoders and encoders are built once here.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

PREFIX = "/kv_release/v1/"
RELEASE_PATH = PREFIX + "release"
HEALTH_PATH = PREFIX + "health"

#: ``notify``: ``EngineClient.notify_kv_transfer_request_rejected`` (vLLM 0.21.0+);
#: ``emulate``: a one-token request submitted and aborted at once (0.9.2-0.20.x).
Action = Literal["notify", "emulate"]
#: ``notified``: handed to D's engine; ``aborted``: the emulated request was aborted before it
#: produced output; ``admitted``: the engine ran it first (D's connector then notified P itself).
Outcome = Literal["notified", "aborted", "admitted"]


class ReleaseRequest(msgspec.Struct, frozen=True, kw_only=True):
    """``POST /kv_release/v1/release``: release P's blocks for one rejected request.

    ``request_id`` becomes the engine request id of the pre-aborted request. D's NIXL
    connector names the request to P by ``kv_transfer_params.remote_request_id`` from
    vLLM 0.13.0 on (any unique id works there); before 0.13.0 it uses the engine id,
    so the sidecar sends P's id for the request (``chatcmpl-<x-request-id>``, ...).
    ``kv_transfer_params`` are passed to the engine unchanged.
    """

    request_id: Annotated[str, msgspec.Meta(min_length=1, max_length=1024)]
    kv_transfer_params: dict[str, Any]
    data_parallel_rank: Annotated[int, msgspec.Meta(ge=0)] | None = None


class ReleaseAccepted(msgspec.Struct, frozen=True, kw_only=True):
    """The 202 answer: what the plugin did (or did before, for a repeated id)."""

    request_id: str
    action: Action
    outcome: Outcome
    duplicate: bool = False


class Health(msgspec.Struct, frozen=True, kw_only=True):
    """``GET /kv_release/v1/health`` (authenticated): the route is served and the engine is there."""

    status: Literal["ok", "no_engine"]
    action: Action | None  # None: the engine client has neither notify nor generate/abort
    vllm_version: str | None = None
    counts: dict[str, int] = msgspec.field(default_factory=dict)


REQUEST_DECODER = msgspec.json.Decoder(ReleaseRequest)
ACCEPTED_DECODER = msgspec.json.Decoder(ReleaseAccepted)
ENCODER = msgspec.json.Encoder()
