"""Whether a request's ``kv_transfer_params`` make it releasable: the one validation, one set of reasons.

Decoded once per inspected request from the raw JSON of the field. A request
is eligible only when it asks D to pull blocks from P (``do_remote_prefill``),
in pull mode, with at least one block, and names where P is. Malformed
parameters are never released (they are logged and counted; the request is
still forwarded, D answers it). ``remote_request_id`` may be absent: P
releases before 0.13.0 do not emit it (the NIXL strategy then derives the id
from ``x-request-id`` and checks the release is that old).

What comes out is a ``ReleaseParams``: every field a release reads, checked,
and the block ids reduced to their count and shape. The ids themselves are
never turned into Python objects: a request may carry hundreds of thousands,
and a list of that many ints per queued job, plus the memory it fragments,
would make the sidecar's footprint grow with the requests it has seen.
Their JSON is validated and counted in place (``_blocks``).
"""

from __future__ import annotations

from enum import StrEnum

import msgspec

from sidecar.wire import PARAMS_VIEW_DECODER, ParamsView

MAX_ID_LEN = 512
MAX_HOST_LEN = 253
MAX_RANKS = 1024  # tp_size * pp_size; a release handshakes every rank
# Block ids one request may name, over all its KV-cache groups (docs/limits.md, "Block ids"): the
# longest context vLLM serves (10,485,760 tokens, Llama 4 Scout) in blocks of 16 tokens (the
# smallest block of vLLM's GPU attention backends for such models) is 655,360 ids per group, and
# Llama 4's hybrid layout sends 4 groups of that length: 2,621,440. Rounded up to a power of two
# for headroom; it bounds the work one request's parameters cost (counted in their JSON, never held).
MAX_BLOCK_IDS = 1 << 22


class Ineligible(StrEnum):
    """Why an inspected request's ``kv_transfer_params`` cannot be released
    (``kvr_ineligible_total{reason}``)."""

    NO_PARAMS = "no_params"  # absent, null, or do_remote_prefill not true
    MALFORMED = "malformed"
    PUSH_MODE = "push_mode"  # P writes to D (0.24.0+); a done notification frees nothing, only the lease
    EMPTY_BLOCKS = "empty_blocks"  # P kept nothing
    NOT_JSON = "not_json"  # the body is not a JSON object: D answers it, nothing names P's blocks
    UNTRUSTED = "untrusted"  # not signed as ``trust`` requires: forwarded, never released
    # router mode, and pd-sidecar (release_client_params off), drop the client's parameters
    CLIENT_PARAMS_DROPPED = "client_params_dropped"
    # router mode: P's answer over prefill_answer_limit did not end in readable parameters
    PREFILL_ANSWER_UNREAD = "prefill_answer_unread"


class ReleaseParams(msgspec.Struct, frozen=True, kw_only=True):
    """What a release needs of ``kv_transfer_params``, validated by ``check`` (its only maker).

    Pull mode and at least one block are guaranteed; ``blocks`` counts the block
    ids over every KV-cache group, ``grouped`` says they came as one list per
    group (vLLM 0.18.0+) rather than one flat list.
    """

    remote_engine_id: str
    remote_request_id: str | None = None  # 0.13.0+
    remote_host: str
    remote_port: int
    tp_size: int = 1
    pp_size: int | None = None  # 0.26.0+ push, 0.29.0+ pull
    dcp_size: int | None = None  # 0.29.0+
    transfer_mode: str | None = None  # 0.28.0+; "pull" here
    remote_num_tokens: int | None = None  # 0.21.0+
    remote_registration_generation: int | None = None  # 0.33.0 (pull)
    blocks: int
    grouped: bool

    @property
    def ranks(self) -> int:
        return self.tp_size * (self.pp_size or 1)


class Eligibility(msgspec.Struct, frozen=True):
    params: ReleaseParams | None
    reason: Ineligible | None
    detail: str = ""


class _Blocks(msgspec.Struct, frozen=True):
    count: int
    grouped: bool


# Valid JSON (msgspec checked it) made only of these characters is an array of arrays... of
# non-negative integers; what is left once they are removed shows the nesting.
_INT_LIST_CHARS = b"0123456789, \t\r\n"
_SPACE = b" \t\r\n"


def _blocks(raw: bytes) -> _Blocks | str:
    """Count and shape of ``remote_block_ids`` from its JSON, or why it is malformed."""
    brackets = raw.translate(None, _INT_LIST_CHARS)
    if brackets == b"[]":  # a flat list: ints, or nothing
        return _Blocks(raw.count(b",") + 1 if raw.strip(b"[]" + _SPACE) else 0, grouped=False)
    groups = len(brackets) // 2 - 1
    if brackets != b"[" + b"[]" * groups + b"]":
        return "remote_block_ids is not a list of ints or of int lists"
    # Lists two deep: a comma after a group's end, or before a group's start, is between
    # elements of the outer list, so an int beside a group shows as a "]," or ",[" that is
    # not part of a "],[" (whitespace aside).
    compact = raw.translate(None, _SPACE)
    between = compact.count(b"],[")
    if compact.count(b"],") != between or compact.count(b",[") != between:
        return "remote_block_ids is not a list of ints or of int lists"
    return _Blocks(raw.count(b",") + 1 - compact.count(b"[]"), grouped=True)


def _problem(p: ParamsView, blocks: _Blocks | str) -> str:
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
    if isinstance(blocks, str):
        return blocks
    if blocks.count > MAX_BLOCK_IDS:
        return f"remote_block_ids holds {blocks.count} ids, over {MAX_BLOCK_IDS}"
    if p.transfer_mode not in (None, "pull", "push"):
        return "transfer_mode is neither pull nor push"
    return ""


def _loose(data: bytes, exc: Exception) -> Eligibility:
    """A type error: malformed if D would act on it (a truthy do_remote_prefill), else not ours."""
    try:
        loose = msgspec.json.decode(data)
    except (msgspec.DecodeError, RecursionError):  # broken, or too deep, past the type error
        return Eligibility(None, Ineligible.MALFORMED, str(exc))
    if not isinstance(loose, dict) or not loose.get("do_remote_prefill"):
        return Eligibility(None, Ineligible.NO_PARAMS)
    return Eligibility(None, Ineligible.MALFORMED, str(exc))


def check(raw: msgspec.Raw | bytes) -> Eligibility:
    """Decode and judge the raw JSON of ``kv_transfer_params``."""
    data = bytes(raw)
    if data in (b"", b"null"):
        return Eligibility(None, Ineligible.NO_PARAMS)
    try:
        view = PARAMS_VIEW_DECODER.decode(data)
    except msgspec.ValidationError as exc:
        return _loose(data, exc)
    except (msgspec.DecodeError, RecursionError) as exc:
        return Eligibility(None, Ineligible.MALFORMED, str(exc))
    if not view.do_remote_prefill:
        return Eligibility(None, Ineligible.NO_PARAMS)
    ids = bytes(view.remote_block_ids)
    blocks = _Blocks(0, grouped=False) if ids == b"null" else _blocks(ids)
    problem = _problem(view, blocks)
    if problem:
        return Eligibility(None, Ineligible.MALFORMED, problem)
    assert isinstance(blocks, _Blocks)
    if view.transfer_mode == "push":
        return Eligibility(None, Ineligible.PUSH_MODE)
    if blocks.count == 0:
        return Eligibility(None, Ineligible.EMPTY_BLOCKS)
    assert view.remote_engine_id and view.remote_host and view.remote_port  # _problem checked them
    params = ReleaseParams(
        remote_engine_id=view.remote_engine_id,
        remote_request_id=view.remote_request_id,
        remote_host=view.remote_host,
        remote_port=view.remote_port,
        tp_size=view.tp_size,
        pp_size=view.pp_size,
        dcp_size=view.dcp_size,
        transfer_mode=view.transfer_mode,
        remote_num_tokens=view.remote_num_tokens,
        remote_registration_generation=view.remote_registration_generation,
        blocks=blocks.count,
        grouped=blocks.grouped,
    )
    return Eligibility(params, None)
