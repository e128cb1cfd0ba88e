"""Whether a request's ``kv_transfer_params`` make it releasable at all.

Decoded once per inspected request from the raw JSON of the field. A request
is eligible only when it asks D to pull blocks from P (``do_remote_prefill``),
in pull mode, with at least one block, and names where P is. Malformed
parameters are never released (they are logged and counted; the request is
still forwarded, D answers it). ``remote_request_id`` may be absent: P
releases before 0.13.0 do not emit it (the NIXL strategy then derives the id
from ``x-request-id`` and checks the release is that old).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

import msgspec

from sidecar.wire import PARAMS_DECODER, KVTransferParams

MAX_ID_LEN = 512
MAX_HOST_LEN = 253
MAX_RANKS = 1024  # tp_size * pp_size; a release handshakes every rank
# Block ids one request may name, over all its KV-cache groups (docs/limits.md, "Block ids"): the
# longest context vLLM serves (10,485,760 tokens, Llama 4 Scout) in blocks of 16 tokens (the
# smallest block of vLLM's GPU attention backends for such models) is 655,360 ids per group, and
# Llama 4's hybrid layout sends 4 groups of that length: 2,621,440. Rounded up to a power of two
# for headroom; it bounds what one queued release job holds (about 36 bytes an id).
MAX_BLOCK_IDS = 1 << 22


class Ineligible(StrEnum):
    NO_PARAMS = "no_params"  # absent, null, or do_remote_prefill not true
    MALFORMED = "malformed"
    PUSH_MODE = "push_mode"  # P writes to D (0.24.0+); a done notification frees nothing, only the lease
    EMPTY_BLOCKS = "empty_blocks"  # P kept nothing


@dataclass(frozen=True, slots=True)
class Eligibility:
    params: KVTransferParams | None
    reason: Ineligible | None
    detail: str = ""


def _blocks_empty(block_ids: list[object] | None) -> bool:
    if not block_ids:
        return True
    if all(isinstance(b, list) for b in block_ids):
        return not any(block_ids)
    return False


def _blocks_valid(block_ids: list[object] | None) -> bool:
    if block_ids is None:
        return True
    if all(isinstance(b, list) for b in block_ids):
        groups: list[list[object]] = block_ids  # type: ignore[assignment]
        if sum(len(group) for group in groups) > MAX_BLOCK_IDS:
            return False
        return all(type(x) is int for group in block_ids for x in group)  # type: ignore[attr-defined]
    return len(block_ids) <= MAX_BLOCK_IDS and all(type(b) is int for b in block_ids)


def _problem(p: KVTransferParams) -> str:
    if not p.remote_engine_id or len(p.remote_engine_id) > MAX_ID_LEN:
        return "remote_engine_id missing or too long"
    if p.remote_request_id is not None and not 0 < len(p.remote_request_id) <= MAX_ID_LEN:
        return "remote_request_id empty or too long"
    if not p.remote_host or len(p.remote_host) > MAX_HOST_LEN:
        return "remote_host missing or too long"
    if p.remote_port is None or not 0 < p.remote_port <= 65535:
        return "remote_port missing or outside 1-65535"
    pp = 1 if p.pp_size is None else p.pp_size
    if p.tp_size < 1 or pp < 1 or p.tp_size * pp > MAX_RANKS:
        return f"tp_size/pp_size must be >= 1 with at most {MAX_RANKS} ranks"
    if not _blocks_valid(p.remote_block_ids):
        return f"remote_block_ids is not a list of ints or of int lists, or holds over {MAX_BLOCK_IDS}"
    return ""


def check(raw: msgspec.Raw | bytes) -> Eligibility:
    """Decode and judge the raw JSON of ``kv_transfer_params``."""
    data = bytes(raw)
    if data in (b"", b"null"):
        return Eligibility(None, Ineligible.NO_PARAMS)
    try:
        params = PARAMS_DECODER.decode(data)
    except msgspec.ValidationError as exc:
        # D acts on a truthy do_remote_prefill; mistyped fields then mean "malformed".
        try:
            loose = msgspec.json.decode(data)
        except (msgspec.DecodeError, RecursionError):  # broken, or too deep, past the type error
            return Eligibility(None, Ineligible.MALFORMED, str(exc))
        if not isinstance(loose, dict) or not loose.get("do_remote_prefill"):
            return Eligibility(None, Ineligible.NO_PARAMS)
        return Eligibility(None, Ineligible.MALFORMED, str(exc))
    except (msgspec.DecodeError, RecursionError) as exc:
        return Eligibility(None, Ineligible.MALFORMED, str(exc))
    if not params.do_remote_prefill:
        return Eligibility(None, Ineligible.NO_PARAMS)
    problem = _problem(params)
    if problem:
        return Eligibility(None, Ineligible.MALFORMED, problem)
    if params.transfer_mode == "push":
        return Eligibility(None, Ineligible.PUSH_MODE)
    if params.transfer_mode not in (None, "pull"):
        return Eligibility(None, Ineligible.MALFORMED, "transfer_mode is neither pull nor push")
    if _blocks_empty(params.remote_block_ids):
        return Eligibility(None, Ineligible.EMPTY_BLOCKS)
    return Eligibility(params, None)
