"""P's side-channel messages: handshake requests, metadata payloads, reply frames.

Written from vLLM's handshake request, reply framing and payload structs, independently of the
sidecar's own NIXL client, so each can check the other. ``NixlAgentMetadata``
has fourteen field layouts across releases; it is encoded from the ordered
field list of ``Release.metadata_fields`` (a msgpack map keyed by field name,
in declaration order, exactly what msgspec makes of vLLM's Struct/dataclass)
rather than from fourteen near-identical Struct classes.
``handshake_payload`` raises exactly where vLLM's listener raises, so the
listener thread dies on the same malformed requests.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgspec

from sidecar.sim.prefill.release import Release

logger = logging.getLogger("sidecar.sim.prefill")

GET_META_MSG = b"get_meta_msg"  # every release
ATTN_BACKEND = "FLASH_ATTN"
KV_CACHE_LAYOUT = "HND"
BYTES_PER_TOKEN = 64  # size of one token's K+V in the simulated cache region

HandshakeKey = int | tuple[int, int]  # tp_rank (<0.26.0) or (pp_rank, tp_rank)

_ENCODER = msgspec.msgpack.Encoder()


class NixlHandshakePayload(msgspec.Struct):
    """Handshake reply envelope, vLLM 0.13.0-0.34.x (a dataclass there; a map on the wire)."""

    compatibility_hash: str
    agent_metadata_bytes: bytes  # a msgpack NixlAgentMetadata


@dataclass(frozen=True, slots=True)
class WorkerIdentity:
    """One P worker's NIXL agent as the side channel describes it."""

    tp_rank: int
    pp_rank: int
    agent_name: str
    agent_metadata: bytes  # nixl_agent.get_agent_metadata()
    base_addr: int  # start of the registered KV region
    block_len: int  # bytes per block


@dataclass(frozen=True, slots=True)
class EngineShape:
    """Engine-wide values every worker's metadata repeats."""

    engine_id: str
    num_blocks: int  # usable blocks; the region also holds the null block 0
    block_size: int
    tp: int
    model: str


def compatibility_hash(release: Release, model: str) -> str:
    """A hex SHA-256 over what vLLM hashes (version, connector version, model, cache shape)."""
    factors = (
        f"vllm_version={release.version}|nixl_connector_version={release.connector_version}|"
        f"model={model}|dtype=torch.float16|num_kv_heads=8|head_size=128|"
        f"num_hidden_layers=1|attn_backend_name={ATTN_BACKEND}|cache_dtype=auto"
    )
    return hashlib.sha256(factors.encode()).hexdigest()


def metadata_values(worker: WorkerIdentity, shape: EngineShape) -> dict[str, Any]:
    """Every NixlAgentMetadata field any release has, with this worker's values."""
    return {
        "engine_id": shape.engine_id,
        "agent_metadata": worker.agent_metadata,
        "kv_caches_base_addr": [worker.base_addr],
        "device_id": worker.tp_rank,
        "num_blocks": shape.num_blocks + 1,
        "tp_size": shape.tp,
        "block_len": worker.block_len,
        "block_lens": [worker.block_len],
        "block_strides": [worker.block_len],
        "attn_backend_name": ATTN_BACKEND,
        "kv_cache_layout": KV_CACHE_LAYOUT,
        "block_size": shape.block_size,
        "ssm_sizes": (0, 0),
        "physical_blocks_per_logical_kv_block": 1,
        "region_num_blocks": None,
        "region_group_ids": None,
        "region_names": None,
        "region_mem_types": None,
        "dcp_size": 1,
        "pcp_size": 1,
        "ple_block_len": None,
        "region_members": [],
        "layer_group_ids": {},
        "packed_member_layouts": {},
    }


def encode_metadata(release: Release, worker: WorkerIdentity, shape: EngineShape) -> bytes:
    """``NixlAgentMetadata`` of ``release`` as a msgpack map in declaration order."""
    values = metadata_values(worker, shape)
    return _ENCODER.encode({name: values[name] for name in release.metadata_fields})


def encode_handshake(release: Release, worker: WorkerIdentity, shape: EngineShape) -> bytes:
    """The first reply frame: bare metadata (<0.13.0) or the payload envelope."""
    inner = encode_metadata(release, worker, shape)
    if not release.payload_envelope:
        return inner
    return _ENCODER.encode(NixlHandshakePayload(compatibility_hash(release, shape.model), inner))


def handshake_key(release: Release, worker: WorkerIdentity) -> HandshakeKey:
    """How the scheduler listener indexes this worker's payload."""
    if release.request_form == "pp_tp":
        return (worker.pp_rank, worker.tp_rank)
    return worker.tp_rank


def handshake_payload(
    release: Release, table: Mapping[Any, bytes], msg: bytes, own_key: HandshakeKey
) -> bytes:
    """The payload vLLM's listener sends for request ``msg``; raises where it raises.

    ``own_key`` is the listener's own worker (per-worker listeners, <=0.11.0,
    answer any single-frame request with it). From 0.11.1 the request names
    the rank: a non-msgpack body, a wrong array length or an unknown rank
    raises (``msgspec.DecodeError``, ``ValueError``/``TypeError``, ``KeyError``).
    """
    if release.request_form == "raw":
        tag: Any = msg
        key: Any = own_key
    else:
        decoded = msgspec.msgpack.decode(msg)
        if release.request_form == "tp":
            tag, key = decoded
        else:
            tag, pp_rank, tp_rank = decoded
            key = (pp_rank, tp_rank)
    if tag != GET_META_MSG:
        logger.warning("Connection listener got unexpected message %s", tag)
    return table[key]


def timestamp_frame(now: float) -> bytes:
    """Second reply frame (0.26.0+): P's ``time.perf_counter()`` as msgpack float64."""
    return _ENCODER.encode(float(now))
