"""``sidecar.proxy.context.tail_params``: only the top-level, last ``kv_transfer_params`` of a large body.

The tail scan runs on a window of a body the sidecar refuses (413) and still
releases from, so a wrong find is a wrong release: it must find the member only
when it is the outermost object's last one, never raise, and return at most a
bounded re-encoding of the window.
"""

from __future__ import annotations

import json
from typing import Any

from hypothesis import example, given
from hypothesis import strategies as st

from sidecar.params import check
from sidecar.proxy.context import TAIL_WINDOW, tail_params
from sidecar.wire import VIEW_DECODER
from tests.property.strategies import ids, json_values, params_dicts, valid_params

KEY = "kv_transfer_params"
keys = st.one_of(ids, st.sampled_from([KEY, "kv_transfer_param", "a", KEY.upper()]))


@st.composite
def bodies(draw: st.DrawFn) -> tuple[bytes, Any]:
    """A JSON object, possibly with kv_transfer_params somewhere, and the value expected back."""
    members: dict[str, Any] = draw(st.dictionaries(keys.filter(lambda k: k != KEY), json_values, max_size=4))
    where = draw(st.sampled_from(["last", "first", "nested", "absent"]))
    params = draw(st.one_of(params_dicts, json_values))
    if where == "last":
        members[KEY] = params
    elif where == "first":
        members = {KEY: params, **members, "z": 1}
    elif where == "nested":
        members["outer"] = {KEY: params}
    ascii_only = draw(st.booleans())
    raw = json.dumps(members, ensure_ascii=ascii_only, indent=draw(st.sampled_from([None, 1]))).encode()
    expected = params if where == "last" and isinstance(params, dict) else None
    return raw, expected


@given(bodies(), st.integers(min_value=0, max_value=200))
def test_finds_only_the_outermost_last_member(case: tuple[bytes, Any], cut: int) -> None:
    raw, expected = case
    found = tail_params(raw)
    if expected is None:
        assert found is None
    else:
        assert found is not None and json.loads(found) == expected
    start = raw.rfind(b'"' + KEY.encode() + b'"')
    if expected is not None and cut <= start:  # any window holding the whole member finds it too
        assert tail_params(raw[cut:]) == found


@given(st.binary(max_size=400))
@example(b'"kv_transfer_params": ' + b"[" * 50_000)
@example(b'"kv_transfer_params": {"a": ' + b"[" * 50_000 + b"]" * 50_000 + b"}}")
@example(b'"kv_transfer_params": {"remote_engine_id": "\xff"}}')
@example(b'{"x": 1, "kv_transfer_params": {"remote_engine_id": "\xff"}}')
def test_never_raises_and_stays_bounded(tail: bytes) -> None:
    found = tail_params(tail)
    if found is not None:
        assert isinstance(json.loads(found.decode("utf-8", "surrogateescape")), dict)
        assert found in tail  # a slice of what was sent, never more
        assert tail.rstrip().endswith(b"}") and b"}" in tail[tail.rfind(found) + len(found) :]


def test_invalid_utf8_in_the_tail_params_is_kept_as_sent_and_judged_as_in_a_body() -> None:
    """Never replaced: the bytes as sent (a router's HMAC covers them), judged exactly as the
    same parameters in a body under the cap are (``VIEW_DECODER`` then ``check``)."""
    raw = json.dumps(valid_params()).encode()[:-1] + b', "y": "\xff"}'
    tail = b'{"x": 1, "kv_transfer_params": ' + raw + b"}"
    found = tail_params(tail)
    assert found == raw
    in_body = check(VIEW_DECODER.decode(tail).kv_transfer_params)
    assert check(found) == in_body


def test_window_is_bounded() -> None:
    assert TAIL_WINDOW == 256 * 1024


def test_a_key_starting_with_an_escaped_quote_is_not_the_parameters() -> None:
    raw = json.dumps({"model": "m", '"kv_transfer_params': valid_params()}).encode()
    assert tail_params(raw) is None
