"""``sidecar.params.check``: what it accepts is exactly what the release path may trust.

``accepts`` below restates the eligibility rules from the module docstring on the
value Python's ``json`` (vLLM's parser) decodes, independently of the msgspec
Struct; the properties compare the two, check the invariants the release path
relies on for every accepted input, and mutate valid parameters into invalid
types. ``check`` must never raise, whatever the bytes.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec
from hypothesis import example, given
from hypothesis import strategies as st

from sidecar.nixl.messages import notification
from sidecar.nixl.versions import WireProfile
from sidecar.params import MAX_BLOCK_IDS, MAX_HOST_LEN, MAX_ID_LEN, MAX_RANKS, Eligibility, Ineligible, check
from tests.property.strategies import encode, json_values, params_dicts, valid_params

PROFILES = [WireProfile.for_version(v) for v in ("0.9.0", "0.21.0", "0.33.0")]


def _int(value: object) -> bool:
    return type(value) is int


def _opt(value: object, kind: type) -> bool:
    return value is None or type(value) is kind


def _typed(p: dict[str, Any]) -> bool:
    """Every known field has the type the Struct declares (absent fields take defaults)."""
    return (
        type(p.get("do_remote_prefill", False)) is bool
        and type(p.get("do_remote_decode", False)) is bool
        and all(_opt(p.get(k), str) for k in ("remote_engine_id", "remote_request_id", "remote_host"))
        and all(_opt(p.get(k), str) for k in ("transfer_mode",))
        and _int(p.get("tp_size", 1))
        and all(
            p.get(k) is None or _int(p.get(k))
            for k in (
                "remote_port",
                "pp_size",
                "dcp_size",
                "remote_num_tokens",
                "remote_registration_generation",
            )
        )
        and _opt(p.get("remote_block_ids"), list)
    )


def _blocks_ok(blocks: Any) -> bool:
    if not isinstance(blocks, list) or not blocks:
        return False
    if all(isinstance(b, list) for b in blocks):
        return all(_int(x) for group in blocks for x in group) and any(blocks)
    return all(_int(b) for b in blocks)


def accepts(p: Any) -> bool:
    """The documented rule: pull, at least one block, P's address, bounded ranks and ids."""
    if not isinstance(p, dict) or not _typed(p) or p.get("do_remote_prefill") is not True:
        return False
    engine, request, host = p.get("remote_engine_id"), p.get("remote_request_id"), p.get("remote_host")
    pp = 1 if p.get("pp_size") is None else p["pp_size"]
    tp = p.get("tp_size", 1)
    return (
        bool(engine)
        and len(engine) <= MAX_ID_LEN
        and (request is None or 0 < len(request) <= MAX_ID_LEN)
        and bool(host)
        and len(host) <= MAX_HOST_LEN
        and p.get("remote_port") is not None
        and 1 <= p["remote_port"] <= 65535
        and tp >= 1
        and pp >= 1
        and tp * pp <= MAX_RANKS
        and p.get("transfer_mode") in (None, "pull")
        and _blocks_ok(p.get("remote_block_ids"))
    )


def assert_release_invariants(result: Eligibility) -> None:
    """What ``sidecar.release`` and ``sidecar.nixl`` take for granted of accepted parameters."""
    p = result.params
    assert p is not None and result.reason is None
    assert p.transfer_mode in (None, "pull")
    assert p.remote_engine_id and len(p.remote_engine_id) <= MAX_ID_LEN
    assert p.remote_host and len(p.remote_host) <= MAX_HOST_LEN
    assert p.remote_request_id is None or 0 < len(p.remote_request_id) <= MAX_ID_LEN
    assert p.remote_port is not None and 1 <= p.remote_port <= 65535 and _int(p.remote_port)
    pp = 1 if p.pp_size is None else p.pp_size
    assert _int(p.tp_size) and p.tp_size >= 1 and pp >= 1 and p.tp_size * pp <= MAX_RANKS
    assert 1 <= p.blocks <= MAX_BLOCK_IDS
    for profile in PROFILES:
        assert profile is not None
        assert 1 <= len(profile.ranks(p)) <= MAX_RANKS
        if p.remote_request_id is not None:  # the id P frees goes on the wire intact
            message = notification(profile, p.remote_request_id)
            assert message.rsplit(b":", 1)[0] == p.remote_request_id.encode() or message == (
                p.remote_request_id.encode()
            )


@given(params_dicts)
@example({**valid_params(), "remote_port": 0})
@example({**valid_params(), "pp_size": 0})
@example({**valid_params(), "remote_block_ids": [[True]]})
@example({**valid_params(), "tp_size": 10**9})
def test_check_accepts_exactly_the_documented_parameters(p: dict[str, Any]) -> None:
    result = check(encode(p))
    assert (result.params is not None) == accepts(p), result
    if result.params is not None:
        assert_release_invariants(result)
        kept = set(FIELD_TYPES) - {"do_remote_prefill", "do_remote_decode", "remote_block_ids"}
        assert all(getattr(result.params, k) == v for k, v in p.items() if k in kept)
        blocks = p["remote_block_ids"]
        grouped = all(isinstance(b, list) for b in blocks)
        assert result.params.grouped is grouped
        assert result.params.blocks == (sum(map(len, blocks)) if grouped else len(blocks))
    else:
        assert result.reason is not None


@given(params_dicts)
def test_accepted_parameters_survive_their_own_encoding(p: dict[str, Any]) -> None:
    """Router mode re-checks ``msgspec.json.encode(params)`` of P's decoded answer: the verdict
    must not change with the encoder."""
    assert check(msgspec.json.encode(p)) == check(encode(p))


FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "do_remote_prefill": (bool,),
    "remote_engine_id": (str,),
    "remote_request_id": (str, type(None)),
    "remote_host": (str,),
    "remote_port": (int,),
    "remote_block_ids": (list, type(None)),
    "tp_size": (int,),
    "pp_size": (int, type(None)),
    "dcp_size": (int, type(None)),
    "transfer_mode": (str, type(None)),
    "remote_num_tokens": (int, type(None)),
    "remote_registration_generation": (int, type(None)),
    "do_remote_decode": (bool,),
}


@given(st.sampled_from(sorted(FIELD_TYPES)), json_values)
def test_a_mistyped_field_never_yields_eligible_parameters(field: str, value: Any) -> None:
    allowed = FIELD_TYPES[field]
    if any(type(value) is kind for kind in allowed):
        return  # not a type change (values are judged by the property above)
    result = check(encode({**valid_params(), field: value}))
    assert result.params is None
    if field != "do_remote_prefill":
        assert result.reason is Ineligible.MALFORMED


@given(st.binary(max_size=200))
@example(b'{"do_remote_prefill": true, "remote_engine_id": "\xff"}')
@example(b'{"do_remote_prefill": true, "remote_request_id": "\\ud800"}')
@example(b"[" * 5000)
@example(b'{"do_remote_prefill": true, "x": ' + b"[" * 5000 + b"]" * 5000 + b"}")
def test_check_never_raises_on_json_it_cannot_read(data: bytes) -> None:
    result = check(data)
    assert result.params is None or accepts(json.loads(data))


@given(json_values)
def test_check_never_raises_on_any_json_value(value: Any) -> None:
    result = check(encode(value))
    assert (result.params is not None) == accepts(value)


def test_ids_with_colons_and_non_ascii_are_kept_intact() -> None:
    p = valid_params(engine_id="eng:1:ü", request_id="req:ä:漢字:1")
    for raw in (encode(p), json.dumps(p, ensure_ascii=False).encode()):
        result = check(raw)
        assert result.params is not None
        assert (result.params.remote_engine_id, result.params.remote_request_id) == (
            "eng:1:ü",
            "req:ä:漢字:1",
        )
    profile = WireProfile.for_version("0.21.0")
    assert profile is not None
    assert notification(profile, "req:ä:漢字:1") == "req:ä:漢字:1:1".encode()


# The longest context vLLM serves (Llama 4 Scout, 10,485,760 tokens) in 16-token blocks, times the
# four KV-cache groups of Llama 4's hybrid layout: the cap must let such a request be released.
LONGEST_REQUEST_IDS = 4 * 10_485_760 // 16


def test_block_lists_are_bounded_at_the_cap() -> None:
    assert MAX_BLOCK_IDS >= LONGEST_REQUEST_IDS
    at_limit = check(encode(valid_params(blocks=list(range(MAX_BLOCK_IDS)))))
    assert at_limit.params is not None and at_limit.params.blocks == MAX_BLOCK_IDS
    assert check(encode(valid_params(blocks=list(range(MAX_BLOCK_IDS + 1))))).reason is Ineligible.MALFORMED


def test_grouped_block_lists_count_every_group() -> None:
    quarter = list(range(MAX_BLOCK_IDS // 4))
    at_limit = check(encode(valid_params(blocks=[quarter] * 4)))
    assert at_limit.params is not None and at_limit.params.blocks == MAX_BLOCK_IDS
    assert at_limit.params.grouped
    past = [quarter, quarter, quarter, [*quarter, 0]]
    assert check(encode(valid_params(blocks=past))).reason is Ineligible.MALFORMED


def test_check_survives_json_that_breaks_after_a_type_error() -> None:
    assert check(b'{"do_remote_prefill": true, "remote_port": "x", }').reason is Ineligible.MALFORMED
    assert check(b'{"remote_port": "x", "y": ' + b"[" * 5000).reason is Ineligible.MALFORMED
