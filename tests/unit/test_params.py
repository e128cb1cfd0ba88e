"""Which kv_transfer_params are releasable, decoded from raw JSON."""

from __future__ import annotations

import msgspec
import pytest

from sidecar.params import Ineligible, check
from sidecar.wire import VIEW_DECODER, lax_bool

GOOD = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_engine_id": "engine-p",
    "remote_request_id": "cmpl-abc-0-12345678",
    "remote_host": "10.0.0.7",
    "remote_port": 5600,
    "remote_block_ids": [[1, 2, 3]],
    "tp_size": 2,
}


def raw(**changes: object) -> bytes:
    params = {**GOOD, **changes}
    return msgspec.json.encode({k: v for k, v in params.items() if v is not DROP})


DROP = object()


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (raw(), None),
        (raw(remote_block_ids=[1, 2]), None),  # flat list, vLLM <= 0.17
        (raw(remote_request_id=DROP), None),  # vLLM < 0.13 emits no remote_request_id
        (raw(transfer_mode="pull"), None),
        (raw(remote_request_id="id:with:colons"), None),
        (raw(remote_request_id="nön-ascii-id"), None),
        (b"null", Ineligible.NO_PARAMS),
        (b"", Ineligible.NO_PARAMS),
        (raw(do_remote_prefill=False), Ineligible.NO_PARAMS),
        (raw(do_remote_prefill=DROP), Ineligible.NO_PARAMS),
        (b'{"do_remote_decode": true}', Ineligible.NO_PARAMS),
        (b"[1, 2]", Ineligible.NO_PARAMS),
        (raw(do_remote_prefill=0), Ineligible.NO_PARAMS),
        (raw(do_remote_prefill="yes"), Ineligible.MALFORMED),  # truthy to D, but mistyped
        (raw(transfer_mode="push"), Ineligible.PUSH_MODE),
        (raw(transfer_mode="teleport"), Ineligible.MALFORMED),
        (raw(remote_block_ids=[]), Ineligible.EMPTY_BLOCKS),
        (raw(remote_block_ids=[[], []]), Ineligible.EMPTY_BLOCKS),
        (raw(remote_block_ids=DROP), Ineligible.EMPTY_BLOCKS),
        (raw(remote_engine_id=DROP), Ineligible.MALFORMED),
        (raw(remote_engine_id=""), Ineligible.MALFORMED),
        (raw(remote_host=DROP), Ineligible.MALFORMED),
        (raw(remote_port=DROP), Ineligible.MALFORMED),
        (raw(remote_port=0), Ineligible.MALFORMED),
        (raw(remote_port=70000), Ineligible.MALFORMED),
        (raw(remote_port=-1), Ineligible.MALFORMED),
        (raw(remote_port="5600"), Ineligible.MALFORMED),
        (raw(tp_size=0), Ineligible.MALFORMED),
        (raw(tp_size=10**9), Ineligible.MALFORMED),
        (raw(pp_size=2000), Ineligible.MALFORMED),
        (raw(remote_request_id=""), Ineligible.MALFORMED),
        (raw(remote_request_id="x" * 513), Ineligible.MALFORMED),
        (raw(remote_host="h" * 300), Ineligible.MALFORMED),
        (raw(remote_block_ids=["a"]), Ineligible.MALFORMED),
        (raw(remote_block_ids=[[1], "a"]), Ineligible.MALFORMED),
        (raw(remote_block_ids=[True]), Ineligible.MALFORMED),
    ],
)
def test_check(data: bytes, reason: Ineligible | None) -> None:
    result = check(data)
    assert result.reason == reason
    assert (result.params is not None) == (reason is None)


def test_eligible_params_carry_fields() -> None:
    params = check(raw()).params
    assert params is not None
    assert (params.remote_host, params.remote_port, params.tp_size) == ("10.0.0.7", 5600, 2)


@pytest.mark.parametrize(
    ("body", "stream", "has_params"),
    [
        (b'{"model": "m", "stream": true, "kv_transfer_params": {"a": 1}}', True, True),
        (b'{"model": "m", "stream": "yes"}', "yes", False),
        (b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}', False, False),
        (b'{"n": 2, "kv_transfer_params": null}', False, False),
    ],
)
def test_view_decodes_only_needed_fields(body: bytes, stream: object, has_params: bool) -> None:
    view = VIEW_DECODER.decode(body)
    assert view.stream == stream
    assert (bytes(view.kv_transfer_params) != b"null") == has_params


@pytest.mark.parametrize("body", [b"not json", b"[1, 2]", b'"str"', b"{", b""])
def test_view_rejects_non_objects(body: bytes) -> None:
    with pytest.raises((msgspec.DecodeError, msgspec.ValidationError)):
        VIEW_DECODER.decode(body)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (True, True),
        (False, False),
        (1, True),
        (0, False),
        (1.0, True),
        (2, None),
        ("true", True),
        ("Yes", True),
        ("on", True),
        ("1", True),
        ("off", False),
        ("F", False),
        (" true", None),  # pydantic does not strip
        ("2", None),
        (None, None),
        ([], None),
    ],
)
def test_lax_bool_reads_like_vllms_request_models(value: object, expected: bool | None) -> None:
    # Checked against pydantic 2 (vLLM's OpenAIBaseModel, lax mode) for a ``stream: bool`` field.
    assert lax_bool(value) is expected


def with_blocks(ids_json: bytes) -> bytes:
    """``GOOD`` with ``remote_block_ids`` spelled exactly as ``ids_json``."""
    body = raw(remote_block_ids=DROP)
    return body[:-1] + b',"remote_block_ids":' + ids_json + b"}"


@pytest.mark.parametrize(
    ("ids_json", "blocks", "grouped"),
    [
        (b"[1,2,3]", 3, False),
        (b"[ 1 , 2 ,\n 3 ]", 3, False),
        (b"[7]", 1, False),
        (b"[[1,2],[3]]", 3, True),
        (b"[[1, 2], [], [3]]", 3, True),  # an empty KV-cache group
        (b"[[ ],[4]]", 1, True),
        (b"[ [ ] ,\n [ 4 , 5 ] ]", 2, True),
        (b"[ 9 ]", 1, False),
        (b"[[0]]", 1, True),
        (b"[" + b",".join(str(i).encode() for i in range(1000, 1100)) + b"]", 100, False),
    ],
)
def test_block_ids_are_counted_without_decoding_them(ids_json: bytes, blocks: int, grouped: bool) -> None:
    params = check(with_blocks(ids_json)).params
    assert params is not None and (params.blocks, params.grouped) == (blocks, grouped)


@pytest.mark.parametrize(
    ("ids_json", "reason"),
    [
        (b"[]", Ineligible.EMPTY_BLOCKS),
        (b"[[],[]]", Ineligible.EMPTY_BLOCKS),
        (b"null", Ineligible.EMPTY_BLOCKS),
        (b"[[1],2]", Ineligible.MALFORMED),  # a group and an int side by side
        (b"[1,[2]]", Ineligible.MALFORMED),
        (b"[[1] ,\n 2]", Ineligible.MALFORMED),
        (b"[1 , [2]]", Ineligible.MALFORMED),
        (b"[[1],2,[3]]", Ineligible.MALFORMED),
        (b"[ ]", Ineligible.EMPTY_BLOCKS),
        (b"[[[1]]]", Ineligible.MALFORMED),  # nested too deep
        (b"[-1]", Ineligible.MALFORMED),  # vLLM's block ids are never negative
        (b"[1.0]", Ineligible.MALFORMED),
        (b"[1e3]", Ineligible.MALFORMED),
        (b'["1"]', Ineligible.MALFORMED),
        (b"[true]", Ineligible.MALFORMED),
        (b"[null]", Ineligible.MALFORMED),
        (b"{}", Ineligible.MALFORMED),
        (b"7", Ineligible.MALFORMED),
        (b'"[1]"', Ineligible.MALFORMED),
    ],
)
def test_block_ids_of_any_other_shape_are_not_released(ids_json: bytes, reason: Ineligible) -> None:
    assert check(with_blocks(ids_json)).reason is reason
