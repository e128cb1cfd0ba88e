"""The prefill simulator's per-release rules as tables (no NIXL, no sockets).

Covers the releases the integration test does not start: counting rules,
heartbeats and reapers, unknown ids, kv_transfer_params fields, metadata
field layouts and the listener's raise-or-answer decisions, from 0.9.0 to
0.33.0, each against vLLM's NIXL connector of that release.
"""

from __future__ import annotations

import re
from typing import Any

import msgspec
import pytest

from sidecar.config import ConfigError
from sidecar.sim.prefill.config import PrefillSimConfig
from sidecar.sim.prefill.notifs import Done, Heartbeat, Malformed, expected_notifications, parse_notification
from sidecar.sim.prefill.openai import emitted_blocks, kv_transfer_params, request_ids
from sidecar.sim.prefill.pool import BlockPool, DuplicateRequest, PoolFull
from sidecar.sim.prefill.release import UnsupportedVersion, release_for
from sidecar.sim.prefill.wire import (
    EngineShape,
    WorkerIdentity,
    encode_handshake,
    handshake_key,
    handshake_payload,
)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def pool(
    version: str, *, tp: int = 1, pp: int = 1, lease: float | None = 10.0, blocks: int = 8
) -> tuple[BlockPool, Clock]:
    clock = Clock()
    return BlockPool(release_for(version), num_blocks=blocks, tp=tp, pp=pp, lease=lease, clock=clock), clock


@pytest.mark.parametrize(
    ("version", "listener", "form", "frames", "envelope", "lease"),
    [
        ("0.9.0", "worker", "raw", 1, False, None),
        ("0.9.2", "worker", "raw", 1, False, None),
        ("0.10.0", "worker", "raw", 1, False, 120.0),
        ("0.11.0", "worker", "raw", 1, False, 120.0),
        ("0.11.1", "scheduler", "tp", 1, False, 480.0),
        ("0.13.0", "scheduler", "tp", 1, True, 480.0),
        ("0.21.0", "scheduler", "tp", 1, True, 480.0),
        ("0.22.0", "scheduler", "tp", 1, True, 30.0),
        ("0.26.0", "scheduler", "pp_tp", 2, True, 30.0),
        ("0.33.0", "scheduler", "pp_tp", 2, True, 30.0),
        ("0.10.1.post1", "worker", "raw", 1, False, 120.0),
    ],
)
def test_release_table(
    version: str, listener: str, form: str, frames: int, envelope: bool, lease: float | None
) -> None:
    release = release_for(version)
    assert release.listener == listener and release.request_form == form
    assert (2 if release.reply_timestamp else 1) == frames
    assert release.payload_envelope is envelope and release.default_lease == lease


@pytest.mark.parametrize("version", ["0.8.5", "0.35.0", "latest", ""])
def test_unsupported_versions_are_refused(version: str) -> None:
    with pytest.raises(UnsupportedVersion):
        release_for(version)


@pytest.mark.parametrize(
    ("version", "raw", "parsed"),
    [
        ("0.9.0", b"cmpl-a-0", Done("cmpl-a-0", None)),
        ("0.9.0", b"cmpl-a-0:1", Done("cmpl-a-0:1", None)),  # 0.9.0 has no count
        ("0.11.0", b"cmpl-a-0:1", Done("cmpl-a-0", "1")),
        ("0.33.0", b"a:b:c:2", Done("a:b:c", "2")),  # split on the last colon
        ("0.33.0", b"nocolon", Malformed("no colon")),
        ("0.33.0", b"\xff\xfe:1", Malformed("not UTF-8")),
        ("0.33.0", b"HB:x,y", Heartbeat(("x", "y"))),
        ("0.21.0", b"HB:x,y", Done("HB", "x,y")),  # no heartbeats before 0.22.0
    ],
)
def test_parse_notification(version: str, raw: bytes, parsed: object) -> None:
    assert parse_notification(release_for(version), raw) == parsed


@pytest.mark.parametrize(
    ("version", "count", "p_tp", "expected"),
    [
        ("0.9.0", None, 2, 1),
        ("0.11.0", "1", 2, 1),
        ("0.11.0", "2", 2, 2),  # tp_ratio = D_tp // P_tp
        ("0.21.0", "1", 2, 1),  # D's TP size <= P's: one reader per rank
        ("0.21.0", "2", 2, 1),
        ("0.21.0", "4", 2, 2),  # D TP 4 on P TP 2: two readers per rank
        ("0.33.0", "3", 2, 3),  # 0.29.0+: the number is the reader count
        ("0.21.0", "3", 2, AssertionError),  # tp_ratio asserts divisibility
        ("0.21.0", "0", 2, ZeroDivisionError),
        ("0.33.0", "x", 2, ValueError),
    ],
)
def test_expected_notifications(version: str, count: str | None, p_tp: int, expected: Any) -> None:
    release = release_for(version)
    if isinstance(expected, int):
        assert expected_notifications(release, count, p_tp) == expected
    else:
        with pytest.raises(expected):
            expected_notifications(release, count, p_tp)


def test_every_rank_must_finish_before_blocks_return() -> None:
    p, _ = pool("0.33.0", tp=2, pp=2)
    p.pin("r", p.allocate("r", 3))
    for rank in range(3):
        p.on_notification(rank, b"r:1")
    assert p.stats()["blocks_in_use"] == 3 and p.stats()["pinned_requests"] == 1
    p.on_notification(3, b"r:1")
    stats = p.stats()
    assert stats["blocks_in_use"] == 0 and stats["freed_by_notification"] == 1
    p.on_notification(0, b"r:1")  # late: the rank no longer holds it
    assert p.stats()["notifs_unknown"] == 1


def test_each_freed_request_is_recorded_with_when_and_why_once() -> None:
    p, clock = pool("0.33.0", lease=5.0)
    for request_id in ("a", "b"):
        p.pin(request_id, p.allocate(request_id, 1))
    clock.now += 1.0
    p.on_notification(0, b"a:1")
    freed_at = clock.now
    clock.now += 5.0
    p.reap(0)  # b's lease ran out
    assert p.take_freed() == [("a", freed_at, "notification"), ("b", clock.now, "expiry")]
    assert p.take_freed() == []  # taken: each is reported once


def test_overshooting_count_never_frees_until_expiry() -> None:
    p, clock = pool("0.33.0", lease=5.0)
    p.pin("r", p.allocate("r", 1))
    p.on_notification(0, b"r:2")
    p.on_notification(0, b"r:2")
    p.on_notification(0, b"r:1")  # count 3 != 1: compared for equality only
    p.reap(0)
    assert p.stats()["pinned_requests"] == 0  # the second r:2 freed it
    p.pin("s", p.allocate("s", 1))
    p.on_notification(0, b"s:2")
    p.on_notification(0, b"s:1")  # count 2 != 1
    clock.now += 5
    p.reap(0)
    assert p.stats()["freed_by_expiry"] == 1


def test_heartbeat_extends_and_oldest_first_reaper_stops_at_live_entry() -> None:
    p, clock = pool("0.22.0", lease=30.0)  # 0.22.0-0.30.x reaper stops at the first live entry
    p.pin("a", p.allocate("a", 1))
    p.pin("b", p.allocate("b", 1))
    clock.now += 25
    p.on_notification(0, b"HB:a,unknown")  # a -> now + 20
    clock.now += 10  # b expired, a still live but first in order
    p.reap(0)
    assert p.stats()["pinned_requests"] == 2 and p.stats()["notifs_unknown"] == 0
    clock.now += 11
    p.reap(0)
    assert p.stats()["freed_by_expiry"] == 2


def test_scan_all_reaper_frees_behind_a_live_entry() -> None:
    p, clock = pool("0.31.0", lease=30.0)
    p.pin("a", p.allocate("a", 1))
    p.pin("b", p.allocate("b", 1))
    clock.now += 25
    p.on_notification(0, b"HB:a")
    clock.now += 10
    p.reap(0)
    stats = p.stats()
    assert stats["freed_by_expiry"] == 1 and stats["pinned_requests"] == 1


def test_no_lease_before_0_10_and_unknown_ids_are_fatal_there() -> None:
    p, clock = pool("0.9.2", lease=None)
    p.pin("r", p.allocate("r", 1))
    clock.now += 10_000
    p.reap(0)
    assert p.stats()["pinned_requests"] == 1
    p.on_notification(0, b"other:1")
    stats = p.stats()
    assert stats["notifs_unknown"] == 1 and stats["worker_errors"] == 1
    p.on_notification(0, b"r:1")
    assert p.stats()["freed_by_notification"] == 1


def test_malformed_notifications_are_counted_and_keep_the_request() -> None:
    p, _ = pool("0.21.0", tp=2)
    p.pin("r", p.allocate("r", 1))
    for raw in (b"r", b"r:x", b"r:3", b"\xff:1"):
        p.on_notification(0, raw)
    stats = p.stats()
    assert stats["notifs_malformed"] == 4 and stats["worker_errors"] == 4
    assert stats["pinned_requests"] == 1 and stats["notifs_per_rank"] == [4, 0]
    p.on_notification(1, b"unknown:x")  # unknown before int(): logged, not raised
    assert p.stats()["notifs_unknown"] == 1 and p.stats()["notifs_malformed"] == 4


def test_pool_full_and_duplicate_ids() -> None:
    p, clock = pool("0.33.0", blocks=4)
    p.pin("r", p.allocate("r", 3))
    with pytest.raises(DuplicateRequest):
        p.allocate("r", 1)
    with pytest.raises(PoolFull):
        p.allocate("s", 2)
    clock.now += 2
    stats = p.stats()
    assert stats["refused_no_blocks"] == 1 and stats["pinned_block_seconds"] == pytest.approx(6.0)


@pytest.mark.parametrize(
    ("version", "present", "absent", "nested"),
    [
        ("0.9.0", set(), {"tp_size", "remote_request_id"}, False),
        ("0.9.2", {"tp_size"}, {"remote_request_id", "remote_num_tokens"}, False),
        ("0.13.0", {"tp_size", "remote_request_id"}, {"remote_num_tokens"}, False),
        ("0.18.0", {"remote_request_id"}, {"remote_num_tokens"}, True),
        ("0.21.0", {"remote_num_tokens"}, {"transfer_mode", "pp_size"}, True),
        ("0.26.0", {"remote_blocks_expiry_time"}, {"transfer_mode", "pp_size"}, True),
        ("0.28.0", {"transfer_mode"}, {"pp_size", "dcp_size"}, True),
        ("0.29.0", {"pp_size", "dcp_size"}, {"remote_registration_generation"}, True),
        ("0.33.0", {"remote_registration_generation"}, set(), True),
    ],
)
def test_kv_transfer_params_fields(version: str, present: set[str], absent: set[str], nested: bool) -> None:
    release = release_for(version)
    params = kv_transfer_params(
        release, blocks=[1, 2], engine_id="e", internal_id="cmpl-x-0", host="h", port=5600,
        tp=2, pp=1, tokens=20, generation=0,
    )  # fmt: skip
    assert present <= set(params) and not absent & set(params)
    assert params["remote_block_ids"] == ([[1, 2]] if nested else [1, 2])
    assert list(params)[:4] == [
        "do_remote_prefill",
        "do_remote_decode",
        "remote_block_ids",
        "remote_engine_id",
    ]


@pytest.mark.parametrize(
    ("version", "route", "pattern"),
    [
        ("0.11.0", "completions", r"cmpl-abc-0"),
        ("0.13.0", "chat", r"chatcmpl-abc"),
        ("0.14.0", "completions", r"cmpl-abc-0-[0-9a-f]{8}"),
        ("0.33.0", "chat", r"chatcmpl-abc-[0-9a-f]{8}"),
    ],
)
def test_internal_request_ids(version: str, route: Any, pattern: str) -> None:
    response_id, internal = request_ids(release_for(version), route, "abc")
    assert re.fullmatch(pattern, internal)
    assert response_id == ("chatcmpl-abc" if route == "chat" else "cmpl-abc")


def test_old_releases_drop_a_trailing_partial_block() -> None:
    assert emitted_blocks(release_for("0.10.0"), [4, 5], 20, 16) == [4]
    assert emitted_blocks(release_for("0.10.0"), [4], 10, 16) == []
    assert emitted_blocks(release_for("0.10.1"), [4, 5], 20, 16) == [4, 5]


WORKER = WorkerIdentity(
    tp_rank=1, pp_rank=0, agent_name="n", agent_metadata=b"md", base_addr=4096, block_len=1024
)
SHAPE = EngineShape("engine", 8, 16, 2, "m")


HEAD = ["engine_id", "agent_metadata", "kv_caches_base_addr"]
SCHED = [*HEAD, "device_id", "num_blocks", "block_lens"]
FIELDS_0_33 = [
    *SCHED, "block_strides", "kv_cache_layout", "block_size", "ssm_sizes", "attn_backend_name",
    "physical_blocks_per_logical_kv_block", "region_num_blocks", "region_group_ids",
    "region_names", "region_mem_types", "dcp_size", "pcp_size", "ple_block_len",
    "region_members", "packed_member_layouts",
]  # fmt: skip


@pytest.mark.parametrize(
    ("version", "fields"),
    [
        ("0.9.0", [*HEAD, "num_blocks"]),
        ("0.9.1", [*HEAD, "num_blocks", "tp_size", "block_len", "attn_backend_name"]),
        ("0.11.1", [*SCHED, "attn_backend_name", "kv_cache_layout", "block_size"]),
        ("0.21.0", [*SCHED, "kv_cache_layout", "block_size", "ssm_sizes", "attn_backend_name",
                    "physical_blocks_per_logical_kv_block"]),
        ("0.33.0", FIELDS_0_33),
    ],
)  # fmt: skip
def test_metadata_field_order(version: str, fields: list[str]) -> None:
    release = release_for(version)
    decoded = msgspec.msgpack.decode(encode_handshake(release, WORKER, SHAPE))
    if release.payload_envelope:
        assert list(decoded) == ["compatibility_hash", "agent_metadata_bytes"]
        assert re.fullmatch(r"[0-9a-f]{64}", decoded["compatibility_hash"])
        decoded = msgspec.msgpack.decode(decoded["agent_metadata_bytes"])
    assert list(decoded) == fields
    assert decoded["engine_id"] == "engine" and decoded["agent_metadata"] == b"md"


@pytest.mark.parametrize(
    ("version", "msg", "outcome"),
    [
        ("0.11.0", b"get_meta_msg", "answer"),
        ("0.11.0", b"garbage", "answer"),  # per-worker listeners answer anything
        ("0.21.0", msgspec.msgpack.encode([b"get_meta_msg", 1]), "answer"),
        ("0.21.0", msgspec.msgpack.encode([b"wrong", 1]), "answer"),  # only a warning
        ("0.21.0", msgspec.msgpack.encode([b"get_meta_msg", 7]), KeyError),
        ("0.21.0", msgspec.msgpack.encode([b"get_meta_msg", 0, 1]), ValueError),
        ("0.33.0", msgspec.msgpack.encode([b"get_meta_msg", 0, 1]), "answer"),
        ("0.33.0", msgspec.msgpack.encode([b"get_meta_msg", 1]), ValueError),
        ("0.33.0", b"\xc1 not msgpack", msgspec.DecodeError),
        ("0.33.0", msgspec.msgpack.encode(5), TypeError),
    ],
)
def test_listener_answers_or_raises_like_vllm(version: str, msg: bytes, outcome: Any) -> None:
    release = release_for(version)
    table = {handshake_key(release, WORKER): b"payload"}
    if outcome == "answer":
        assert handshake_payload(release, table, msg, own_key=1) == b"payload"
    else:
        with pytest.raises(outcome):
            handshake_payload(release, table, msg, own_key=1)


@pytest.mark.parametrize(
    ("settings", "field"),
    [
        ({"vllm_version": "0.8.0"}, "vllm_version"),
        ({"vllm_version": "0.21.0", "pp": 2}, "pp"),
        ({"tp": 0}, "tp"),
        ({"lease": -1.0}, "lease"),
        ({"side_channel_port": 70000}, "side_channel_port"),
    ],
)
def test_config_errors_name_the_field(settings: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError) as info:
        PrefillSimConfig(**settings)
    assert info.value.field == field


def test_config_defaults_follow_the_release() -> None:
    old = PrefillSimConfig(vllm_version="0.11.0")
    assert old.effective_side_channel_port == 5557 and old.effective_lease == 120.0
    new = PrefillSimConfig(vllm_version="0.33.0", lease=0)
    assert new.effective_side_channel_port == 5600 and new.effective_lease is None
