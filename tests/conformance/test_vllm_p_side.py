"""Conformance: vLLM's own P-side code accepts the sidecar's handshake and frees on its release.

At test time the vLLM wheel of each release under test is downloaded
(``pip download --no-deps vllm==X``, cached in ``$KVR_VLLM_WHEEL_DIR`` or
``~/.cache/kv-release-sidecar/vllm`` by ``tests.conformance.wheels``; never vendored) and the NIXL connector's
P-side pieces are read out of it with ``zipfile``: the ``NixlAgentMetadata`` /
``NixlHandshakePayload`` classes, the side-channel listener (and, from 0.11.1,
the scheduler's ``set_xfer_handshake_metadata`` that encodes and serves the
metadata), the worker's notification handler ``_get_new_notifs`` and the lease
expiry (inside ``get_finished`` before 0.31.0, ``_reap_expired_send_leases``
after). Only those functions are compiled (with ``ast``), into a module whose
vLLM imports are small stubs, so nothing pulls in torch. They run in a child
process ("P") on real NIXL agents, created through ``nixl._api`` as vLLM does
(a shim maps it to ``nixl_cu12``). The test drives the real ``NixlReleaser``
against it. A failed download fails the test loudly; only a wheel that is not
cached while no package index answers is skipped (one line).

P is ``tests.conformance.vllm_p``.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from sidecar.nixl.versions import NEWEST
from sidecar.release.base import JobResult
from tests.conformance.vllm_p import VERSIONS, PProcess, job, p_request_id, releaser
from tests.conformance.vllm_source import spoken
from tests.conformance.wheels import fetch_wheel

pytestmark = pytest.mark.nixl

# (version, tp, pp): PP only where pull reads pp_size (0.29.0+)
TOPOLOGY = {
    "0.34.0": (2, 2),
    "0.33.0": (2, 2),
    "0.29.0": (1, 2),
    "0.21.0": (2, 1),
    "0.13.0": (2, 1),
    "0.11.0": (2, 1),
}


@pytest.fixture(scope="module", params=VERSIONS)
def wheel(request: pytest.FixtureRequest) -> tuple[str, Path]:
    version: str = request.param
    started = time.monotonic()
    path = fetch_wheel(version)  # a failed download fails the test; skipped only offline and uncached
    print(f"vllm {version} wheel ready in {time.monotonic() - started:.1f}s: {path.name}")
    return version, path


@pytest.fixture
def prefill(wheel: tuple[str, Path]) -> Any:
    version, path = wheel
    tp, pp = TOPOLOGY.get(spoken(version), (2, 1))
    p = PProcess(path, tp, pp)
    yield version, p
    p.stop()


async def test_release_frees_the_request_on_every_rank(prefill: Any) -> None:
    version, p = prefill
    ranks = sorted((pp, tp) for pp in range(p.pp) for tp in range(p.tp))
    first, second = p_request_id(version, "a"), p_request_id(version, "b")
    await p.hold(first)
    await p.hold(second)
    sidecar = await releaser(version)
    try:
        assert await sidecar.release(job(version, p, "a")) is JobResult.SENT
        await p.await_(lambda: p.finished(first) == ranks, f"{first} freed on every rank")
        # A second sidecar (fresh agent, no cache) handshakes again: the listener survived.
        other = await releaser(version)
        try:
            assert await other.release(job(version, p, "b")) is JobResult.SENT
            await p.await_(lambda: p.finished(second) == ranks, f"{second} freed on every rank")
        finally:
            await other.close()
        p.send("alive")
        await p.await_(lambda: any("alive" in e for e in p.events), "liveness answer")
        alive = next(e["alive"] for e in p.events if "alive" in e)
        assert alive and all(alive)
        assert p.finished(first) == ranks  # still exactly once per rank
        assert not [e for e in p.events if "error" in e]
    finally:
        await sidecar.close()


async def test_late_release_after_expiry_is_only_logged(prefill: Any) -> None:
    version, p = prefill
    ranks = sorted((pp, tp) for pp in range(p.pp) for tp in range(p.tp))
    rid = p_request_id(version, "late")
    await p.hold(rid, ttl=0.2)
    await p.await_(lambda: p.finished(rid) == ranks, "P's own expiry frees it")
    assert p.logs("Releasing expired KV blocks")
    sidecar = await releaser(version)
    try:
        assert await sidecar.release(job(version, p, "late")) is JobResult.SENT
        await p.await_(lambda: len(p.logs("unrecognized request")) >= len(ranks), "unknown id logged")
        assert p.finished(rid) == ranks and not [e for e in p.events if "error" in e]
    finally:
        await sidecar.close()


@pytest.mark.parametrize("reported", ["0.99.0", "0.35.0rc1"])
async def test_a_newer_release_than_any_known_frees_on_every_rank(reported: str) -> None:
    """D reports a release no one has made; P runs the newest known release's own code at TP 2
    (PP 2): the newest known wire is used, vLLM's P frees the request on every rank and logs no
    unknown id."""
    version = ".".join(map(str, NEWEST))
    p = PProcess(fetch_wheel(version), 2, 2)
    try:
        ranks = sorted((pp, tp) for pp in range(p.pp) for tp in range(p.tp))
        rid = p_request_id(version, "future")
        await p.hold(rid)
        sidecar = await releaser(version, reported=reported)
        try:
            assert await sidecar.release(job(version, p, "future")) is JobResult.SENT
            await p.await_(lambda: p.finished(rid) == ranks, f"{rid} freed on every rank")
            await p.settle()
            assert not p.logs("unrecognized request") and not [e for e in p.events if "error" in e]
        finally:
            await sidecar.close()
    finally:
        p.stop()
