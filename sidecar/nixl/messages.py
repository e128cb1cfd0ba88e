"""Every NIXL side-channel message, as msgspec Structs, with the vLLM releases it belongs to.

The releaser reads only ``engine_id`` and ``agent_metadata`` from P's reply
(vLLM's ``NixlAgentMetadata``, inside a ``NixlHandshakePayload`` from 0.13.0):
both payloads are msgpack maps keyed by field name in every
release, so the lenient ``*View`` Structs decode all of them (unknown keys
are ignored). The full per-release ``NixlAgentMetadata`` layouts, what P
encodes, are the tests' (``tests/support/nixl_layouts.py``): they play P with them.
Decoders and encoders are built once and reused.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from sidecar.nixl import BadReply, UnknownWire
from sidecar.nixl.versions import WireProfile

GET_META_MSG = b"get_meta_msg"  # the request's first element in every release


class GetMetaTp(msgspec.Struct, array_like=True, frozen=True):
    """Handshake request, vLLM 0.11.1-0.25.x: msgpack ``[b"get_meta_msg", tp_rank]``."""

    msg: bytes
    tp_rank: int


class GetMetaPpTp(msgspec.Struct, array_like=True, frozen=True):
    """Handshake request, vLLM 0.26.0-0.34.0: msgpack ``[b"get_meta_msg", pp_rank, tp_rank]``."""

    msg: bytes
    pp_rank: int
    tp_rank: int


class AgentMetadataView(msgspec.Struct, frozen=True):
    """The two fields of ``NixlAgentMetadata`` a releaser needs (vLLM 0.9.0-0.34.0)."""

    engine_id: str
    agent_metadata: bytes


class HandshakePayloadView(msgspec.Struct, frozen=True):
    """``NixlHandshakePayload`` (vLLM 0.13.0-0.34.0); the hash is not checked (1.4)."""

    agent_metadata_bytes: bytes
    compatibility_hash: str = ""


@dataclass(frozen=True, slots=True)
class PeerMetadata:
    """What one P worker's reply yields."""

    engine_id: str
    agent_metadata: bytes


_ENCODER = msgspec.msgpack.Encoder()
_AGENT_DECODER = msgspec.msgpack.Decoder(AgentMetadataView)
_PAYLOAD_DECODER = msgspec.msgpack.Decoder(HandshakePayloadView)
_TIMESTAMP_DECODER = msgspec.msgpack.Decoder(float)


def encode_request(profile: WireProfile, pp_rank: int, tp_rank: int) -> bytes:
    """The handshake request for one P worker in ``profile``'s framing (1.2)."""
    request = profile.wire.request
    if request == "raw":
        return GET_META_MSG
    if request == "tp":
        return _ENCODER.encode(GetMetaTp(GET_META_MSG, tp_rank))
    return _ENCODER.encode(GetMetaPpTp(GET_META_MSG, pp_rank, tp_rank))


def decode_reply(profile: WireProfile, frames: list[bytes]) -> PeerMetadata:
    """``engine_id`` and ``agent_metadata`` from P's reply frames; raises ``BadReply``, or
    ``UnknownWire`` when the profile is assumed for a newer vLLM (its wire changed)."""
    try:
        return _decode_reply(profile, frames)
    except BadReply as exc:
        if profile.assumed:
            newest = ".".join(map(str, profile.high))
            raise UnknownWire(
                f"vLLM {profile.text} is newer than every release this sidecar knows, and P's "
                f"handshake reply is not vLLM {newest}'s ({exc}): nothing is sent to P"
            ) from exc
        raise


def _decode_reply(profile: WireProfile, frames: list[bytes]) -> PeerMetadata:
    if len(frames) != profile.wire.reply_frames:
        raise BadReply(f"expected {profile.wire.reply_frames} reply frame(s), got {len(frames)}")
    try:
        document = frames[0]
        if profile.wire.payload == "handshake_payload":
            document = _PAYLOAD_DECODER.decode(document).agent_metadata_bytes
        view = _AGENT_DECODER.decode(document)
        if len(frames) == 2:
            _TIMESTAMP_DECODER.decode(frames[1])  # P's perf_counter; only its shape is checked
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as exc:
        raise BadReply(f"undecodable handshake reply: {exc}") from exc
    if not view.agent_metadata:
        raise BadReply("handshake reply has empty agent_metadata")
    return PeerMetadata(view.engine_id, view.agent_metadata)


def notification(profile: WireProfile, request_id: str) -> bytes:
    """The "done reading" message that frees ``request_id`` once on one rank (2.2).

    ``<id>`` for 0.9.0; ``<id>:1`` from 0.9.1 (one reader per P rank: P splits on
    the last colon, so ids may contain colons).
    """
    if profile.wire.notification == "bare":
        return request_id.encode()
    return f"{request_id}:1".encode()
