"""Side-channel messages: exact request bytes, lenient reply decoding, notification text."""

from __future__ import annotations

import msgspec
import pytest

from sidecar.nixl import BadReply
from sidecar.nixl.messages import decode_reply, encode_request, notification
from sidecar.nixl.versions import Version, WireProfile
from tests.support.nixl_layouts import AGENT_METADATA_LAYOUTS, HandshakePayload, agent_metadata_layout


def profile(text: str) -> WireProfile:
    p = WireProfile.for_version(text)
    assert p is not None
    return p


@pytest.mark.parametrize(
    ("version", "pp", "tp", "expected"),
    [
        ("0.11.0", 1, 3, b"get_meta_msg"),  # raw bytes, the rank is in the port
        # msgpack fixarray(2): bin8(12) "get_meta_msg", positive fixint 3
        ("0.11.1", 0, 3, b"\x92\xc4\x0cget_meta_msg\x03"),
        ("0.25.1", 0, 0, b"\x92\xc4\x0cget_meta_msg\x00"),
        # fixarray(3): bin, pp, tp
        ("0.26.0", 1, 2, b"\x93\xc4\x0cget_meta_msg\x01\x02"),
        ("0.33.0", 0, 7, b"\x93\xc4\x0cget_meta_msg\x00\x07"),
    ],
)
def test_request_bytes(version: str, pp: int, tp: int, expected: bytes) -> None:
    assert encode_request(profile(version), pp, tp) == expected


def test_request_matches_what_vllm_encodes() -> None:
    # vLLM D: msgspec.msgpack.encode((GET_META_MSG, remote_pp_rank, remote_rank)) (0.26.0+)
    assert encode_request(profile("0.33.0"), 1, 5) == msgspec.msgpack.encode((b"get_meta_msg", 1, 5))
    assert encode_request(profile("0.21.0"), 0, 5) == msgspec.msgpack.encode((b"get_meta_msg", 5))


def reply(version: str, engine: str = "eng", blob: bytes = b"agent-md") -> list[bytes]:
    """Frames P of ``version`` sends, built from the release's own metadata layout."""
    p = profile(version)
    md = agent_metadata_layout(p.low)(engine_id=engine, agent_metadata=blob)
    data = msgspec.msgpack.encode(md)
    if p.wire.payload == "handshake_payload":
        data = msgspec.msgpack.encode(HandshakePayload("ab" * 32, data))
    frames = [data]
    if p.wire.reply_frames == 2:
        frames.append(msgspec.msgpack.encode(1234.5))
    return frames


LAYOUT_VERSIONS = ["0.9.0", "0.9.1", "0.9.2", "0.10.1", "0.11.0", "0.11.1", "0.13.0", "0.18.0", "0.20.0"]
LAYOUT_VERSIONS += ["0.21.0", "0.26.0", "0.29.0", "0.33.0"]


@pytest.mark.parametrize("version", LAYOUT_VERSIONS)
def test_reply_of_every_layout_decodes(version: str) -> None:
    meta = decode_reply(profile(version), reply(version))
    assert (meta.engine_id, meta.agent_metadata) == ("eng", b"agent-md")


def test_every_layout_is_a_map_with_engine_id_and_agent_metadata_first() -> None:
    for since, layout in AGENT_METADATA_LAYOUTS:
        fields = msgspec.structs.fields(layout)
        assert [f.name for f in fields[:2]] == ["engine_id", "agent_metadata"], since
        encoded = msgspec.msgpack.decode(msgspec.msgpack.encode(layout(engine_id="e", agent_metadata=b"m")))
        assert isinstance(encoded, dict) and len(encoded) == len(fields)


@pytest.mark.parametrize(
    ("version", "name"),
    [((0, 9, 0), "V0900"), ((0, 10, 2), "V1001"), ((0, 12, 0), "V1101"), ((0, 19, 1), "V1800"),
     ((0, 28, 0), "V2100"), ((0, 33, 0), "V2900")],
)  # fmt: skip
def test_layout_by_release(version: Version, name: str) -> None:
    assert agent_metadata_layout(version).__name__.endswith(name)


def test_unknown_keys_and_extra_fields_are_ignored() -> None:
    inner = msgspec.msgpack.encode({"engine_id": "e", "agent_metadata": b"m", "future_field": [1, 2]})
    outer = msgspec.msgpack.encode({"agent_metadata_bytes": inner, "compatibility_hash": "h", "x": 1})
    ts = msgspec.msgpack.encode(0.5)
    assert decode_reply(profile("0.33.0"), [outer, ts]).agent_metadata == b"m"


@pytest.mark.parametrize(
    ("version", "frames", "problem"),
    [
        ("0.33.0", [b"x"], "2 reply frame"),  # a 0.26+ P always sends the timestamp frame
        ("0.21.0", [b"a", b"b"], "1 reply frame"),
        ("0.11.0", [b"\xc1"], "undecodable"),  # not msgpack
        ("0.13.0", [msgspec.msgpack.encode({"engine_id": "e", "agent_metadata": b"m"})], "undecodable"),
        ("0.11.0", [msgspec.msgpack.encode({"engine_id": "e"})], "undecodable"),
        ("0.11.0", [msgspec.msgpack.encode({"engine_id": "e", "agent_metadata": b""})], "empty"),
        ("0.33.0", [reply("0.33.0")[0], b"not-a-float"], "undecodable"),
    ],
)
def test_bad_replies(version: str, frames: list[bytes], problem: str) -> None:
    with pytest.raises(BadReply, match=problem) as info:
        decode_reply(profile(version), frames)
    assert info.value.reason == "bad_reply"


@pytest.mark.parametrize(
    ("version", "request_id", "message"),
    [
        ("0.9.0", "chatcmpl-a", b"chatcmpl-a"),
        ("0.9.1", "chatcmpl-a", b"chatcmpl-a:1"),
        ("0.21.0", "cmpl-x-0-1a2b3c4d", b"cmpl-x-0-1a2b3c4d:1"),
        ("0.33.0", "id:with:colons", b"id:with:colons:1"),  # P splits on the last colon
        ("0.33.0", "h\u00e9", "h\u00e9:1".encode()),
    ],
)
def test_notification(version: str, request_id: str, message: bytes) -> None:
    assert notification(profile(version), request_id) == message
    if profile(version).wire.notification == "count":
        rid, count = message.decode().rsplit(":", 1)  # what P does with it
        assert (rid, int(count)) == (request_id, 1)
