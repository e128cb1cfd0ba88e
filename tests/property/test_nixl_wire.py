"""NIXL side-channel messages: hostile replies fail as ``BadReply``, notifications carry ids intact,
and the version consistency check never passes parameters its own rules contradict.

P's handshake reply is the one message the sidecar decodes from another host;
``decode_reply`` must raise nothing but ``BadReply`` (which the pipeline
retries) and return bounded values. ``notification`` must put any id P can
have on the wire so that P, splitting on the last colon, gets it back.
"""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from sidecar.nixl import BadReply
from sidecar.nixl.messages import PeerMetadata, decode_reply, notification
from sidecar.nixl.versions import RELEASES, RULES, WireProfile, check_params, engine_request_id, parse_version
from sidecar.params import check
from tests.property.strategies import encode, ids, params_dicts
from tests.support.nixl_layouts import HandshakePayload, agent_metadata_layout

PROFILES = [p for p in (WireProfile.for_version(".".join(map(str, v))) for v in RELEASES) if p is not None]
profiles = st.sampled_from(PROFILES)
msgpack_values = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(min_value=-(2**63), max_value=2**64 - 1),  # what msgpack can carry
        st.floats(allow_nan=False),
        st.text(max_size=8),
        st.binary(max_size=8),
    ),
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=16), children, max_size=3)
    ),
    max_leaves=10,
)
field_names = st.sampled_from(
    ["engine_id", "agent_metadata", "agent_metadata_bytes", "compatibility_hash", "x"]
)


@st.composite
def documents(draw: st.DrawFn) -> bytes:
    """A msgpack map shaped like P's metadata, with any values; or raw bytes."""
    if draw(st.booleans()):
        return draw(st.binary(max_size=64))
    fields = draw(st.dictionaries(field_names, msgpack_values | st.binary(max_size=16) | st.text(max_size=8)))
    if draw(st.booleans()):
        inner = msgspec.msgpack.encode(fields)
        fields = {"compatibility_hash": "h", "agent_metadata_bytes": inner}
    return msgspec.msgpack.encode(fields)


@given(profiles, st.lists(documents(), max_size=3))
@example(PROFILES[-1], [msgspec.msgpack.encode({"agent_metadata_bytes": b"\xc1"}), b""])
def test_replies_decode_or_raise_bad_reply(profile: WireProfile, frames: list[bytes]) -> None:
    try:
        peer = decode_reply(profile, frames)
    except BadReply:
        return
    assert isinstance(peer, PeerMetadata)
    assert isinstance(peer.engine_id, str) and peer.agent_metadata
    assert len(peer.engine_id) + len(peer.agent_metadata) <= sum(map(len, frames))  # nothing invented


@given(profiles, ids, st.binary(min_size=1, max_size=64))
def test_replies_p_sends_decode_to_what_p_sent(profile: WireProfile, engine: str, blob: bytes) -> None:
    metadata = agent_metadata_layout(profile.low)(engine_id=engine, agent_metadata=blob)
    data = msgspec.msgpack.encode(metadata)
    if profile.wire.payload == "handshake_payload":
        data = msgspec.msgpack.encode(HandshakePayload("ab" * 32, data))
    frames = [data] + ([msgspec.msgpack.encode(12.5)] if profile.wire.reply_frames == 2 else [])
    assert decode_reply(profile, frames) == PeerMetadata(engine, blob)


@pytest.mark.parametrize("version", ["0.11.0", "0.33.0"])
def test_deeply_nested_reply_is_a_bad_reply(version: str) -> None:
    profile = WireProfile.for_version(version)
    assert profile is not None
    deep = b"\x91" * 20_000 + b"\xc0"  # [[[...[nil]...]]] in an unknown field
    if profile.wire.payload == "handshake_payload":
        doc = b"\x82\xb4agent_metadata_bytes\xc4\x01x\xa1y" + deep
    else:
        doc = b"\x83\xa9engine_id\xa1e\xaeagent_metadata\xc4\x01m\xa1x" + deep
    frames = [doc] + ([msgspec.msgpack.encode(1.0)] if profile.wire.reply_frames == 2 else [])
    with pytest.raises(BadReply):
        decode_reply(profile, frames)


@given(profiles, ids)
@example(PROFILES[-1], "req:ä:漢字:1")
@example(PROFILES[-1], "a:b:c")
def test_notification_carries_any_id_intact(profile: WireProfile, request_id: str) -> None:
    message = notification(profile, request_id)
    if profile.wire.notification == "bare":
        assert message == request_id.encode()
    else:  # P splits on the last colon: the id comes back whole, colons and all
        head, _, count = message.rpartition(b":")
        assert (head.decode(), count) == (request_id, b"1")


@given(profiles, params_dicts)
def test_consistency_check_follows_its_own_rules(profile: WireProfile, p: dict[str, Any]) -> None:
    result = check(encode(p))
    if result.params is None:
        return
    params = result.params
    problem = check_params(profile, params)
    for rule in RULES:
        if rule.field == "nested remote_block_ids":
            present: bool | None = any(isinstance(b, list) for b in params.remote_block_ids or [])
        else:
            present = getattr(params, rule.field) is not None
        if (present and profile.high < rule.since) or (not present and profile.low >= rule.since):
            assert problem, (rule, profile.text)
    if not problem:
        request_id = engine_request_id(profile, params, "xid", "/v1/chat/completions")
        if profile.wire.has_remote_request_id:
            assert request_id == (params.remote_request_id or None)


@given(st.text(max_size=30))
@example("0.21.0")
@example("\u0660.\u0662\u0661.\u0660")  # Arabic-Indic digits
@example("0.21.0rc1")
@example("v0.33.0+cu128")
def test_version_strings_give_a_profile_or_none(text: str) -> None:
    profile = WireProfile.for_version(text)
    assert profile is None or profile.low <= profile.high


def test_a_version_with_thousands_of_digits_is_unknown() -> None:
    assert parse_version("0." + "1" * 5000) is None
