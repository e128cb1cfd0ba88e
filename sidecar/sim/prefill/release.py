"""What the simulated prefill node (P) does differently in each vLLM release.

``release_for("0.21.0")`` returns a ``Release``: one frozen record of every
behaviour of P's NIXL connector and OpenAI server that changed between vLLM
0.9.0 and 0.34.x, with the boundaries taken from vLLM's own source,
release by release. The rest of the simulator
only reads these fields, so a release boundary lives in exactly one place.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal, TypeVar

VersionKey = tuple[int, int, int]
Listener = Literal["worker", "scheduler"]
RequestForm = Literal["raw", "tp", "pp_tp"]
CountRule = Literal["first", "equal", "d_tp"]

OLDEST: VersionKey = (0, 9, 0)
NEWEST: VersionKey = (0, 34, 99)
T = TypeVar("T")
_VERSION = re.compile(r"^v?(\d+)\.(\d+)(?:\.(\d+))?")

# NixlAgentMetadata field order (= msgpack map key order).
_F_0_9_0 = ("engine_id", "agent_metadata", "kv_caches_base_addr", "num_blocks")
_F_0_13_0 = (
    *("engine_id", "agent_metadata", "kv_caches_base_addr", "device_id", "num_blocks"),
    *("block_lens", "kv_cache_layout", "block_size"),
)
_F_0_21_0 = (*_F_0_13_0, "ssm_sizes", "attn_backend_name", "physical_blocks_per_logical_kv_block")
_F_0_29_HEAD = (
    *("engine_id", "agent_metadata", "kv_caches_base_addr", "device_id", "num_blocks"),
    *("block_lens", "block_strides", "kv_cache_layout", "block_size", "ssm_sizes"),
    *("attn_backend_name", "physical_blocks_per_logical_kv_block"),
)
_REGIONS = ("region_num_blocks", "region_group_ids", "region_names", "region_mem_types")
_MEMBERS = ("region_members", "packed_member_layouts")
_MEMBERS_0_34 = ("region_members", "layer_group_ids", "packed_member_layouts")
METADATA_FIELDS: tuple[tuple[VersionKey, tuple[str, ...]], ...] = (
    ((0, 9, 0), _F_0_9_0),
    ((0, 9, 1), (*_F_0_9_0, "tp_size", "block_len", "attn_backend_name")),
    ((0, 9, 2), (*_F_0_9_0, "block_len", "attn_backend_name")),
    ((0, 10, 1), (*_F_0_9_0, "block_len", "attn_backend_name", "kv_cache_layout")),
    ((0, 11, 0), (*_F_0_9_0, "block_lens", "attn_backend_name", "kv_cache_layout")),
    ((0, 11, 1), (*_F_0_13_0[:6], "attn_backend_name", *_F_0_13_0[6:])),
    ((0, 13, 0), _F_0_13_0),
    ((0, 18, 0), (*_F_0_13_0, "ssm_sizes")),
    ((0, 20, 0), (*_F_0_13_0, "ssm_sizes", "attn_backend_name")),
    ((0, 21, 0), _F_0_21_0),
    ((0, 29, 0), (*_F_0_29_HEAD, "dcp_size", "pcp_size")),
    ((0, 30, 0), (*_F_0_29_HEAD, *_REGIONS, "dcp_size", "pcp_size")),
    ((0, 31, 0), (*_F_0_29_HEAD, *_REGIONS, "dcp_size", "pcp_size", *_MEMBERS)),
    ((0, 32, 0), (*_F_0_29_HEAD, *_REGIONS, "dcp_size", "pcp_size", "ple_block_len", *_MEMBERS)),
    ((0, 34, 0), (*_F_0_29_HEAD, *_REGIONS, "dcp_size", "pcp_size", "ple_block_len", *_MEMBERS_0_34)),
)

# NIXL_CONNECTOR_VERSION, hashed into compatibility_hash from 0.13.0.
CONNECTOR_VERSIONS: tuple[tuple[VersionKey, int], ...] = (
    ((0, 13, 0), 2),
    ((0, 21, 0), 3),
    ((0, 22, 0), 4),
    ((0, 26, 0), 5),
    ((0, 28, 0), 7),
    ((0, 29, 0), 9),
    ((0, 30, 0), 11),
    ((0, 31, 0), 13),
    ((0, 32, 0), 14),
    ((0, 33, 0), 15),
    ((0, 34, 0), 16),
)


class UnsupportedVersion(ValueError):
    """A version string the simulator cannot model (not 0.9.0 - 0.34.x)."""


def parse_version(text: str) -> VersionKey:
    """``"0.10.1.post1"`` -> ``(0, 10, 1)``; raises ``UnsupportedVersion``."""
    match = _VERSION.match(text.strip())
    if match is None:
        raise UnsupportedVersion(f"{text!r} is not a vLLM version like 0.21.0")
    key = (int(match[1]), int(match[2]), int(match[3] or 0))
    if not OLDEST <= key <= NEWEST:
        raise UnsupportedVersion(f"{text!r} is outside the modelled range 0.9.0 - 0.34.x")
    return key


def _pick(table: tuple[tuple[VersionKey, T], ...], key: VersionKey, default: T) -> T:
    chosen = default
    for since, value in table:
        if key >= since:
            chosen = value
    return chosen


@dataclass(frozen=True, slots=True)
class Release:
    """Every release-dependent behaviour of P, for one vLLM version."""

    version: str
    key: VersionKey
    # Side channel: listener, request, reply framing and payload.
    listener: Listener  # one ROUTER per worker at base+rank, or one per engine at base
    request_form: RequestForm  # raw bytes, msgpack [msg, tp] or [msg, pp, tp]
    reply_timestamp: bool  # second reply frame with P's perf_counter
    payload_envelope: bool  # NixlHandshakePayload{compatibility_hash, agent_metadata_bytes}
    connector_version: int | None
    metadata_fields: tuple[str, ...]
    supports_pp: bool  # handshake keyed by (pp, tp)
    default_side_channel_port: int
    # Notifications, leases, unknown ids.
    count_rule: CountRule
    default_lease: float | None  # None: blocks stay until notified
    heartbeats: bool  # "HB:<id>,<id>" extends leases
    reap_scans_all: bool  # 0.31.0+; before, the reaper stops at the first live entry
    unknown_is_fatal: bool  # 0.9.x / 0.10.0: an unknown id kills P's engine
    # kv_transfer_params and ids.
    remote_request_id: bool
    random_id_suffix: bool
    nested_block_ids: bool
    drops_partial_block: bool
    tp_size_param: bool
    remote_num_tokens: bool
    expiry_time_param: bool
    transfer_mode: bool
    pp_size_param: bool
    dcp_size_param: bool
    registration_generation: bool
    # OpenAI server.
    nested_error_body: bool

    @property
    def scheduler_listener(self) -> bool:
        """True when one listener serves every worker (0.11.1+)."""
        return self.listener == "scheduler"


def release_for(version: str) -> Release:
    """The behaviour table row for ``version``; raises ``UnsupportedVersion``."""
    v = parse_version(version)
    return Release(
        version=version.strip(),
        key=v,
        listener="worker" if v < (0, 11, 1) else "scheduler",
        request_form="raw" if v < (0, 11, 1) else "tp" if v < (0, 26, 0) else "pp_tp",
        reply_timestamp=v >= (0, 26, 0),
        payload_envelope=v >= (0, 13, 0),
        connector_version=_pick(CONNECTOR_VERSIONS, v, None),
        metadata_fields=_pick(METADATA_FIELDS, v, _F_0_9_0),
        supports_pp=v >= (0, 26, 0),
        default_side_channel_port=5557 if v < (0, 11, 1) else 5600,
        count_rule=_count_rule(v),
        default_lease=_default_lease(v),
        heartbeats=v >= (0, 22, 0),
        reap_scans_all=v >= (0, 31, 0),
        unknown_is_fatal=v < (0, 10, 1),
        remote_request_id=v >= (0, 13, 0),
        random_id_suffix=v >= (0, 14, 0),
        nested_block_ids=v >= (0, 18, 0),
        drops_partial_block=v < (0, 10, 1),
        tp_size_param=v >= (0, 9, 2),
        remote_num_tokens=v >= (0, 21, 0),
        expiry_time_param=v >= (0, 26, 0),
        transfer_mode=v >= (0, 28, 0),
        pp_size_param=v >= (0, 29, 0),
        dcp_size_param=v >= (0, 29, 0),
        registration_generation=v >= (0, 33, 0),
        nested_error_body=v >= (0, 10, 1),
    )


def _count_rule(v: VersionKey) -> CountRule:
    if v < (0, 9, 1):
        return "first"  # the message is the bare id
    if (0, 14, 0) <= v < (0, 29, 0):
        return "d_tp"  # n is D's TP size, turned into readers by tp_ratio
    return "equal"  # n is the number of readers of this rank


def _default_lease(v: VersionKey) -> float | None:
    if v < (0, 10, 0):
        return None
    if v < (0, 11, 1):
        return 120.0  # VLLM_NIXL_ABORT_REQUEST_TIMEOUT
    if v < (0, 22, 0):
        return 480.0
    return 30.0  # kv_lease_duration
