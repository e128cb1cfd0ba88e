"""``NixlAgentMetadata`` and ``NixlHandshakePayload`` as P encodes them, per vLLM release.

The sidecar decodes only ``engine_id`` and ``agent_metadata`` of P's reply
(``sidecar.nixl.messages.AgentMetadataView``, unknown keys ignored); these are
the full layouts of vLLM's NIXL connector, which the tests encode to play P.
Extend ``AGENT_METADATA_LAYOUTS`` when a vLLM release changes the layout
(docs/dev/testing.md, "Taking a new vLLM release in").
"""

from __future__ import annotations

import msgspec

from sidecar.nixl.versions import Version


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
