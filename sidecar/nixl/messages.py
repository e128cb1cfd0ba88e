"""Every NIXL side-channel message, as msgspec Structs, with the vLLM releases it belongs to.

The releaser reads only ``engine_id`` and ``agent_metadata`` from P's reply
(vLLM's ``NixlAgentMetadata``, inside a ``NixlHandshakePayload`` from 0.13.0):
both payloads are msgpack maps keyed by field name in every
release, so the lenient ``*View`` Structs decode all of them (unknown keys
are ignored). The full per-release ``NixlAgentMetadata`` layouts below are
what P encodes; the tests and the load generator use them to play P.
Decoders and encoders are built once and reused.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from sidecar.nixl import BadReply, UnknownWire
from sidecar.nixl.versions import Version, WireProfile

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


class HandshakePayload(msgspec.Struct, frozen=True):
    """``NixlHandshakePayload`` as P encodes it (vLLM 0.13.0-0.34.0)."""

    compatibility_hash: str
    agent_metadata_bytes: bytes


# --- NixlAgentMetadata as P encodes it, per release range (vLLM's nixl connector) ----------
# Only engine_id and agent_metadata matter; the rest carry defaults so a fake P can build them.


class AgentMetadataV0900(msgspec.Struct):
    """vLLM 0.9.0."""

    engine_id: str
    agent_metadata: bytes
    kv_caches_base_addr: list[int] = []
    num_blocks: int = 0


class AgentMetadataV0901(msgspec.Struct):
    """vLLM 0.9.1."""

    engine_id: str
    agent_metadata: bytes
    kv_caches_base_addr: list[int] = []
    num_blocks: int = 0
    tp_size: int = 1
    block_len: int = 0
    attn_backend_name: str = "FLASH_ATTN"


class AgentMetadataV0902(msgspec.Struct):
    """vLLM 0.9.2-0.10.0 (tp_size removed)."""

    engine_id: str
    agent_metadata: bytes
    kv_caches_base_addr: list[int] = []
    num_blocks: int = 0
    block_len: int = 0
    attn_backend_name: str = "FLASH_ATTN"


class AgentMetadataV1001(msgspec.Struct):
    """vLLM 0.10.1-0.10.2."""

    engine_id: str
    agent_metadata: bytes
    kv_caches_base_addr: list[int] = []
    num_blocks: int = 0
    block_len: int = 0
    attn_backend_name: str = "FLASH_ATTN"
    kv_cache_layout: str = "HND"


class AgentMetadataV1100(msgspec.Struct):
    """vLLM 0.11.0 (block_len -> block_lens)."""

    engine_id: str
    agent_metadata: bytes
    kv_caches_base_addr: list[int] = []
    num_blocks: int = 0
    block_lens: list[int] = []
    attn_backend_name: str = "FLASH_ATTN"
    kv_cache_layout: str = "HND"


class AgentMetadataV1101(msgspec.Struct):
    """vLLM 0.11.1-0.12.0 (a dataclass in vLLM from here on; same map encoding)."""

    engine_id: str
    agent_metadata: bytes
    kv_caches_base_addr: list[int] = []
    device_id: int = 0
    num_blocks: int = 0
    block_lens: list[int] = []
    attn_backend_name: str = "FLASH_ATTN"
    kv_cache_layout: str = "HND"
    block_size: int = 16


class AgentMetadataV1300(msgspec.Struct):
    """vLLM 0.13.0-0.17.x (attn_backend_name moved into the compatibility hash)."""

    engine_id: str
    agent_metadata: bytes
    kv_caches_base_addr: list[int] = []
    device_id: int = 0
    num_blocks: int = 0
    block_lens: list[int] = []
    kv_cache_layout: str = "HND"
    block_size: int = 16


class AgentMetadataV1800(AgentMetadataV1300):
    """vLLM 0.18.0-0.19.x."""

    ssm_sizes: tuple[int, int] = (0, 0)


class AgentMetadataV2000(AgentMetadataV1800):
    """vLLM 0.20.0."""

    attn_backend_name: str = "FLASH_ATTN"


class AgentMetadataV2100(AgentMetadataV2000):
    """vLLM 0.21.0-0.28.x."""

    physical_blocks_per_logical_kv_block: int = 1


class AgentMetadataV2900(msgspec.Struct):
    """vLLM 0.29.0-0.33.0 (0.30.0 adds region_*, 0.31.0 region_members and packed layouts,
    0.32.0 ple_block_len; the later additions all have defaults and are encoded)."""

    engine_id: str
    agent_metadata: bytes
    kv_caches_base_addr: list[int] = []
    device_id: int = 0
    num_blocks: int = 0
    block_lens: list[int] = []
    block_strides: list[int] = []
    kv_cache_layout: str = "HND"
    block_size: int = 16
    ssm_sizes: tuple[int, int] = (0, 0)
    attn_backend_name: str = "FLASH_ATTN"
    physical_blocks_per_logical_kv_block: int = 1
    region_num_blocks: list[int] | None = None
    region_group_ids: list[int] | None = None
    region_names: list[str] | None = None
    region_mem_types: list[str] | None = None
    dcp_size: int = 1
    pcp_size: int = 1
    ple_block_len: int | None = None
    region_members: list[list[str]] = []
    packed_member_layouts: dict[str, tuple[int, int]] = {}


class AgentMetadataV3400(AgentMetadataV2900):
    """vLLM 0.34.0 (``layer_group_ids``: the cache group of each layer in ``region_members``;
    vLLM encodes it before ``packed_member_layouts``, a map's key order no reader depends on)."""

    layer_group_ids: dict[str, int] = {}


AGENT_METADATA_LAYOUTS: tuple[tuple[Version, type[msgspec.Struct]], ...] = (
    ((0, 34, 0), AgentMetadataV3400),
    ((0, 29, 0), AgentMetadataV2900),
    ((0, 21, 0), AgentMetadataV2100),
    ((0, 20, 0), AgentMetadataV2000),
    ((0, 18, 0), AgentMetadataV1800),
    ((0, 13, 0), AgentMetadataV1300),
    ((0, 11, 1), AgentMetadataV1101),
    ((0, 11, 0), AgentMetadataV1100),
    ((0, 10, 1), AgentMetadataV1001),
    ((0, 9, 2), AgentMetadataV0902),
    ((0, 9, 1), AgentMetadataV0901),
    ((0, 9, 0), AgentMetadataV0900),
)


def agent_metadata_layout(version: Version) -> type[msgspec.Struct]:
    """The ``NixlAgentMetadata`` layout P of ``version`` encodes."""
    for since, layout in AGENT_METADATA_LAYOUTS:
        if version >= since:
            return layout
    raise ValueError(f"no NIXL connector before vLLM 0.9.0: {version}")


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
