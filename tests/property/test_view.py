"""``sidecar.wire.VIEW_DECODER``: the proxy sees what D will see, and bad bytes fail in a documented way.

The view must agree with Python's ``json`` (vLLM's parser) on every field it
reads, duplicates included (both keep the last), and fail only with
``msgspec.DecodeError`` / ``msgspec.ValidationError`` on bytes that are not a
JSON object, which the proxy forwards untouched. Nesting deeper than msgspec's
limit (about 1000 levels, less on a deep stack) raises ``RecursionError``
instead: the proxy must treat that like any other unreadable body.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from sidecar.wire import VIEW_DECODER
from tests.property.strategies import encode, ids, json_values, params_dicts

FIELDS = ("stream", "n", "kv_transfer_params", "request_id")
bodies = st.dictionaries(
    st.one_of(st.sampled_from(FIELDS), ids),
    st.one_of(json_values, params_dicts),
    max_size=6,
)


@given(bodies, st.booleans())
def test_view_reads_what_json_reads(body: dict[str, Any], ascii_only: bool) -> None:
    raw = json.dumps(body, ensure_ascii=ascii_only).encode()
    view = VIEW_DECODER.decode(raw)
    assert view.stream == body.get("stream", False)
    assert view.n == body.get("n")
    assert view.request_id == body.get("request_id")
    params = bytes(view.kv_transfer_params)
    assert json.loads(params) == body.get("kv_transfer_params")
    if "kv_transfer_params" in body:
        assert len(params) <= len(raw)  # a slice of the body, never more


@given(st.lists(st.tuples(st.sampled_from(FIELDS), json_values), min_size=1, max_size=6))
def test_duplicate_keys_resolve_like_json(members: list[tuple[str, Any]]) -> None:
    raw = ("{" + ", ".join(f"{json.dumps(k)}: {json.dumps(v)}" for k, v in members) + "}").encode()
    expected = json.loads(raw)  # the last duplicate wins
    view = VIEW_DECODER.decode(raw)
    assert view.stream == expected.get("stream", False)
    assert json.loads(bytes(view.kv_transfer_params)) == expected.get("kv_transfer_params")


@given(st.binary(max_size=300))
@example(b"")
@example(b"\xff\xfe{}")
@example(b'{"stream": "\xff"}')
@example(b"[]")
@example(b'{"kv_transfer_params": ')
def test_unreadable_bodies_fail_with_documented_errors(data: bytes) -> None:
    try:
        view = VIEW_DECODER.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return
    assert len(bytes(view.kv_transfer_params)) <= len(data)


@given(json_values.filter(lambda v: not isinstance(v, dict)))
def test_a_json_value_that_is_not_an_object_is_a_validation_error(value: Any) -> None:
    with pytest.raises(msgspec.ValidationError):
        VIEW_DECODER.decode(encode(value))


def test_invalid_utf8_in_a_skipped_field_is_not_read() -> None:
    """msgspec skips fields the view does not name without checking their UTF-8: the body is
    forwarded and D (whose parser does check) answers 400; the parameters still count."""
    view = VIEW_DECODER.decode(b'{"prompt": "\xff\xfe", "stream": true, "kv_transfer_params": null}')
    assert view.stream is True


@pytest.mark.parametrize("depth", [2_000, 10_000])
def test_nesting_past_msgspecs_limit_raises_recursion_error(depth: int) -> None:
    """Not a DecodeError: a caller that catches only msgspec's errors crashes on such a body."""
    body = b'{"messages": ' + b"[" * depth + b"]" * depth + b"}"
    with pytest.raises(RecursionError):
        VIEW_DECODER.decode(body)
    assert json.loads(b"[" * 500 + b"]" * 500) is not None  # the interpreter is left usable


def test_moderate_nesting_is_read() -> None:
    body = b'{"messages": ' + b"[" * 200 + b"]" * 200 + b', "stream": true}'
    assert VIEW_DECODER.decode(body).stream is True
