"""How ``check`` judges D's release and the control probe's answer, per strategy: tables.

The end-to-end runs against real servers are in ``tests/integration/test_check.py``;
here D answers every request 503 (``httpx.MockTransport``), so the release
judged is ``vllm_version`` alone, or none.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest

from sidecar.checks import Context, Status
from sidecar.checks.decode import _probe_finding, check_version
from sidecar.config import Config, ReleaseStrategy
from sidecar.config.settings import UnknownVllm
from sidecar.release.http import Probe


@pytest.fixture
async def d_down() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(transport=httpx.MockTransport(lambda _: httpx.Response(503))) as client:
        yield client


@pytest.mark.parametrize(
    ("strategy", "version", "unsafe", "status"),
    [
        ("nixl", "0.33.0", False, "ok"),
        ("nixl", "0.34.0", False, "ok"),
        ("nixl", "0.10.1", False, "ok"),
        ("nixl", "0.10.0", False, "fail"),  # a late notification crashes this P: nixl refuses
        ("nixl", "0.10.0", True, "warn"),
        ("auto", "0.9.2", False, "fail"),
        ("http", "0.10.0", False, "ok"),  # D's own connector notifies: no crash to fear
        ("nixl", "0.99.0", False, "warn"),  # newer: released as the newest known, said so
        ("auto", "0.99.0", False, "warn"),
        ("http", "0.99.0", False, "warn"),
        ("dry-run", "0.99.0", False, "warn"),
        ("nixl", "0.8.0", False, "fail"),
        ("auto", "0.26.0rc1", False, "fail"),  # straddles a wire-format change
        ("http", "0.26.0rc1", False, "warn"),
        ("off", "0.8", False, "warn"),
        ("nixl", "", False, "fail"),  # no vllm_version, and D gives none
        ("http", "", False, "warn"),
    ],
)
async def test_version_judged_by_the_strategy(
    d_down: httpx.AsyncClient, strategy: ReleaseStrategy, version: str, unsafe: bool, status: Status
) -> None:
    config = Config(release=strategy, vllm_version=version, allow_unsafe_vllm=unsafe)
    (finding,) = await check_version(Context(config, {}, d_down))
    assert (finding.name, finding.status) == ("version", status), finding.line()
    assert bool(finding.fix) == (status != "ok")


@pytest.mark.parametrize(
    ("strategy", "policy", "status", "says"),
    [
        ("nixl", "newest", "warn", "wire and rules while P's handshake reply decodes"),
        ("nixl", "refuse", "fail", "refuses every release (unknown_version; unknown_vllm is refuse)"),
        ("auto", "refuse", "warn", "the NIXL fallback refuses every one"),
        ("auto", "newest", "warn", "the NIXL fallback: nixl releases use vLLM 0.34.0's wire"),
    ],
)
async def test_a_newer_vllm_is_judged_by_the_setting(
    d_down: httpx.AsyncClient, strategy: ReleaseStrategy, policy: UnknownVllm, status: Status, says: str
) -> None:
    config = Config(release=strategy, vllm_version="0.35.0", unknown_vllm=policy)
    (finding,) = await check_version(Context(config, {}, d_down))
    assert finding.status == status, finding.line()
    assert "newer than the releases this sidecar knows (0.9.0-0.34.0)" in finding.line()
    assert says in finding.line()
    assert "upgrade kv-release-sidecar" in finding.fix


@pytest.mark.parametrize(
    ("strategy", "probe", "token", "status"),
    [
        ("http", "present", True, "ok"),
        ("http", "present", False, "warn"),  # D runs the plugin insecure
        ("auto", "unauthorized", False, "fail"),
        ("auto", "forbidden", True, "fail"),
        ("http", "absent", True, "fail"),
        ("auto", "absent", True, "warn"),  # auto releases through NIXL
        ("auto", "no_engine", True, "fail"),
        ("http", "unreachable", True, "fail"),
        ("http", "error", True, "fail"),
    ],
)
async def test_control_probe_judged_by_the_strategy(
    d_down: httpx.AsyncClient, strategy: ReleaseStrategy, probe: Probe, token: bool, status: Status
) -> None:
    context = Context(Config(release=strategy), {}, d_down)
    finding = _probe_finding(context, probe, "http://d/kv_release/v1/health", token)
    assert finding.status == status, finding.line()
    assert finding.line().startswith(f"{status:<4}  control: ")
