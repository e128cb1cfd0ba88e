"""Version strings -> wire profiles, and the consistency of kv_transfer_params with a release."""

from __future__ import annotations

from typing import Any

import pytest

from sidecar.nixl.versions import (
    WireFormat,
    WireProfile,
    check_params,
    engine_request_id,
    newer_than_known,
    parse_version,
)
from sidecar.params import ReleaseParams
from tests.support.fakes import release_params


@pytest.mark.parametrize(
    ("text", "release", "pre"),
    [
        ("0.21.0", (0, 21, 0), False),
        ("v0.33.0", (0, 33, 0), False),
        ("0.10.1.1", (0, 10, 1), False),  # a post release folds into its base
        ("0.9.0.post1", (0, 9, 0), False),
        ("0.13.0+cu128", (0, 13, 0), False),
        ("0.11", (0, 11, 0), False),
        ("0.26.0rc1", (0, 26, 0), True),
        ("0.21.0.dev3+g1234abc", (0, 21, 0), True),
        (" 0.27.1 ", (0, 27, 1), False),
    ],
)
def test_parse_version(text: str, release: tuple[int, int, int], pre: bool) -> None:
    parsed = parse_version(text)
    assert parsed is not None and (parsed.release, parsed.pre) == (release, pre)


@pytest.mark.parametrize("text", ["", "latest", "0", "0.x.1", "0.21.0-beta", "0.21.0foo"])
def test_parse_version_rejects_garbage(text: str) -> None:
    assert parse_version(text) is None


# version -> (request, reply frames, listener, payload, notification, remote_request_id, pp on pull)
PROFILES = [
    ("0.9.0", ("raw", 1, "worker", "agent_metadata", "bare", False, False)),
    ("0.9.2", ("raw", 1, "worker", "agent_metadata", "count", False, False)),
    ("0.11.0", ("raw", 1, "worker", "agent_metadata", "count", False, False)),
    ("0.11.1", ("tp", 1, "scheduler", "agent_metadata", "count", False, False)),
    ("0.12.0", ("tp", 1, "scheduler", "agent_metadata", "count", False, False)),
    ("0.13.0", ("tp", 1, "scheduler", "handshake_payload", "count", True, False)),
    ("0.25.1", ("tp", 1, "scheduler", "handshake_payload", "count", True, False)),
    ("0.26.0", ("pp_tp", 2, "scheduler", "handshake_payload", "count", True, False)),
    ("0.28.0", ("pp_tp", 2, "scheduler", "handshake_payload", "count", True, False)),
    ("0.29.0", ("pp_tp", 2, "scheduler", "handshake_payload", "count", True, True)),
    ("0.33.0", ("pp_tp", 2, "scheduler", "handshake_payload", "count", True, True)),
]


@pytest.mark.parametrize(("text", "expected"), PROFILES)
def test_wire_format_per_release(text: str, expected: tuple[Any, ...]) -> None:
    profile = WireProfile.for_version(text)
    assert profile is not None
    w = profile.wire
    got = (
        w.request,
        w.reply_frames,
        w.listener,
        w.payload,
        w.notification,
        w.has_remote_request_id,
        w.pp_on_pull,
    )
    assert got == expected


@pytest.mark.parametrize(
    ("text", "safe", "fix"),
    [("0.9.2", False, False), ("0.10.0", False, False), ("0.10.1", True, False), ("0.21.0", True, True)],
)
def test_safety_and_engine_fix(text: str, safe: bool, fix: bool) -> None:
    profile = WireProfile.for_version(text)
    assert profile is not None and (profile.safe_unknown_id, profile.engine_fix) == (safe, fix)


@pytest.mark.parametrize(
    "text", ["0.8.5", "0.35.0", "0.34.1", "1.0.0", "0.26.0rc1", "0.11.1.dev2", "0.9.0rc1"]
)
def test_unknown_or_straddling_releases_have_no_profile(text: str) -> None:
    assert WireProfile.for_version(text) is None


@pytest.mark.parametrize("text", ["0.35.0", "0.34.1", "1.0.0", "0.35.0rc1", "0.34.1.dev3+gabc"])
def test_a_newer_release_gets_the_newest_profile_marked_assumed(text: str) -> None:
    profile = WireProfile.for_version(text, "newest")
    newest = WireProfile.for_version("0.34.0")
    assert profile is not None and newest is not None
    assert profile.assumed and not newest.assumed
    assert (profile.low, profile.high, profile.wire) == ((0, 34, 0), (0, 34, 0), newest.wire)
    assert profile.safe_unknown_id and profile.engine_fix and profile.text == text
    assert newer_than_known(text)


@pytest.mark.parametrize("text", ["0.8.5", "0.26.0rc1", "0.34.0", "0.34.0rc1", "latest", ""])
def test_newest_policy_changes_nothing_below_the_newest(text: str) -> None:
    assert WireProfile.for_version(text, "newest") == WireProfile.for_version(text)
    assert not newer_than_known(text)


def test_pre_release_within_one_format_gets_the_older_end() -> None:
    profile = WireProfile.for_version("0.21.0rc2")
    assert profile is not None
    assert (profile.low, profile.high) == ((0, 20, 2), (0, 21, 0))
    assert not profile.engine_fix  # the fix may not be in the pre-release yet
    assert profile.wire == WireFormat.of((0, 21, 0))


def test_ports_and_ranks() -> None:
    worker, scheduler = WireProfile.for_version("0.11.0"), WireProfile.for_version("0.29.0")
    assert worker is not None and scheduler is not None
    assert [worker.port(5557, tp) for tp in range(3)] == [5557, 5558, 5559]
    assert scheduler.port(5600, 3) == 5600
    params = params_of("0.33.0", tp_size=2, pp_size=2)
    assert scheduler.ranks(params) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    old = WireProfile.for_version("0.28.0")
    assert old is not None and old.ranks(params) == [(0, 0), (0, 1)]  # pp_size unread on pull


def params_of(version: str, **override: Any) -> ReleaseParams:
    """What P of ``version`` sends in ``kv_transfer_params``, with overrides (None removes a field)."""
    v = parse_version(version)
    assert v is not None
    low = v.release
    fields: dict[str, Any] = {
        "do_remote_prefill": True,
        "remote_engine_id": "p",
        "remote_host": "10.0.0.1",
        "remote_port": 5600,
        "remote_block_ids": [1, 2],
    }
    if low >= (0, 13, 0):
        fields["remote_request_id"] = "r"
    if low >= (0, 18, 0):
        fields["remote_block_ids"] = [[1, 2]]
    if low >= (0, 21, 0):
        fields["remote_num_tokens"] = 3
    if low >= (0, 28, 0):
        fields["transfer_mode"] = "pull"
    if low >= (0, 29, 0):
        fields["pp_size"] = fields["dcp_size"] = 1
    if low >= (0, 33, 0):
        fields["remote_registration_generation"] = 0
    fields.update(override)
    return release_params({k: v for k, v in fields.items() if v is not None})


@pytest.mark.parametrize(
    "version",
    ["0.9.2", "0.10.1", "0.12.0", "0.13.0", "0.17.1", "0.18.0", "0.21.0", "0.28.0", "0.29.0", "0.33.0"],
)
def test_params_of_the_same_release_are_consistent(version: str) -> None:
    profile = WireProfile.for_version(version)
    assert profile is not None and check_params(profile, params_of(version)) == ""


@pytest.mark.parametrize(
    ("claimed", "actual", "field"),
    [
        ("0.33.0", "0.21.0", "transfer_mode"),  # config says 0.33, P is 0.21
        ("0.33.0", "0.32.0", "remote_registration_generation"),
        ("0.29.0", "0.28.0", "pp_size"),
        ("0.21.0", "0.20.0", "remote_num_tokens"),
        ("0.13.0", "0.12.0", "remote_request_id"),
        ("0.18.0", "0.17.1", "nested remote_block_ids"),
        ("0.12.0", "0.13.0", "remote_request_id"),  # the other way: a newer P than claimed
        ("0.17.1", "0.18.0", "nested remote_block_ids"),
        ("0.20.0", "0.21.0", "remote_num_tokens"),
        ("0.27.0", "0.28.0", "transfer_mode"),
        ("0.28.0", "0.29.0", "pp_size"),
        ("0.32.0", "0.33.0", "remote_registration_generation"),
    ],
)
def test_params_of_another_release_are_inconsistent(claimed: str, actual: str, field: str) -> None:
    profile = WireProfile.for_version(claimed)
    assert profile is not None
    problem = check_params(profile, params_of(actual))
    assert problem.startswith(field)


def test_pre_release_accepts_both_ends_of_its_range() -> None:
    profile = WireProfile.for_version("0.21.0rc1")  # code between 0.20.2 and 0.21.0
    assert profile is not None
    assert check_params(profile, params_of("0.21.0")) == ""
    assert check_params(profile, params_of("0.20.0")) == ""
    assert check_params(profile, params_of("0.19.0", remote_block_ids=[1])) != ""


@pytest.mark.parametrize(
    ("version", "route", "x_request_id", "expected"),
    [
        ("0.33.0", "/v1/chat/completions", "x", "r"),  # remote_request_id, whatever the route
        ("0.13.0", "/v1/responses", "", "r"),
        ("0.12.0", "/v1/chat/completions", "abc", "chatcmpl-abc"),
        ("0.11.0", "/v1/completions", "abc", "cmpl-abc-0"),
        ("0.9.2", "/v1/chat/completions", "abc", "chatcmpl-abc"),
        ("0.12.0", "/v1/messages", "abc", "chatcmpl-abc"),  # the chat handler's id
        ("0.12.0", "/inference/v1/generate", "abc", None),  # not known before remote_request_id
        ("0.11.0", "/v1/responses", "abc", None),  # the body's request_id, not X-Request-Id
        ("0.11.0", "/v1/chat/completions", "", None),  # no header: vLLM drew a random id
    ],
)
def test_engine_request_id(version: str, route: str, x_request_id: str, expected: str | None) -> None:
    profile = WireProfile.for_version(version)
    assert profile is not None
    assert engine_request_id(profile, params_of(version), x_request_id, route) == expected


def test_responses_before_0_13_use_the_body_request_id() -> None:
    profile = WireProfile.for_version("0.11.0")
    assert profile is not None
    params = params_of("0.11.0")
    assert engine_request_id(profile, params, "abc", "/v1/responses", "resp_client-1") == "resp_client-1"
    # other routes still follow X-Request-Id, whatever the body says
    assert engine_request_id(profile, params, "abc", "/v1/completions", "resp_client-1") == "cmpl-abc-0"
