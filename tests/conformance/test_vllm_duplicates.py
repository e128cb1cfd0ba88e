"""Conformance: what a second "done" notification does to vLLM's own P, order by order.

When D's own fix (vLLM 0.21.0+) notifies P and the sidecar releases the same
request too, P gets both. With D's TP twice P's, every P rank expects two
notifications, one from each D worker that reads from it, and frees when its
count *equals* the number it derives from the latest message: D's TP size
through ``tp_ratio`` in 0.14.0-0.28.x (``<id>:4`` from a TP=4 D), the reader
count itself from 0.29.0 (``<id>:2``). The sidecar sends ``<id>:1``, which
means "one reader" in both.

This runs vLLM's P code from the wheel (the harness of ``vllm_p.py``:
listener, notification handler and lease expiry on real NIXL agents, P with
TP=2) against two real NIXL agents playing D's two readers and the sidecar's
own ``NixlReleaser``. The orders and the recorded results are data in
``tests/conformance/duplicate_orders.py``, which also holds the prefill
simulator to them (``tests/unit/test_sim_prefill_vllm_outcomes.py``).
Each message is delivered to every P rank and consumed by P's step loop
before the next one leaves, so the order P sees is the order written in
``ORDERS``. The recorded result (``RESULT``) is the message after
which every rank reported the request finished, or ``"lease"`` when none did
and only P's lease expiry freed it.

Finding (0.21.0, 0.33.0 and 0.34.0 alike): the sidecar's message between D's two
strands the request on every rank until the lease; before or after D's, it
frees (early, or it is logged as "unrecognized"). ``docs/vllm-releases.md``
("Duplicate notifications") draws the consequences.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from typing import Any

import pytest
import zmq.asyncio

from sidecar.nixl.handshake import HandshakeClient, Target
from sidecar.nixl.peer import NixlPeer
from sidecar.nixl.versions import WireProfile
from sidecar.release.base import JobResult
from tests.conformance.duplicate_orders import (
    ORDERS,
    P_TP,
    RECORDED,
    RESULT,
    d_message,
    sidecar_message,
    unrecognized,
)
from tests.conformance.vllm_p import PProcess, job, p_request_id, releaser
from tests.conformance.vllm_source import spoken
from tests.conformance.wheels import fetch_wheel

pytestmark = pytest.mark.nixl

VERSIONS = [v for v in os.environ.get("KVR_CONFORMANCE_DUPLICATE_VLLM", ",".join(RECORDED)).split(",") if v]
LEASE = 3.0  # seconds P holds the request (its lease, or its timeout before 0.22.0)


class DReader:
    """One of D's workers as P sees it: its own NIXL agent, handshaken with every P rank."""

    def __init__(self) -> None:
        self.peer = NixlPeer()
        self.agents: list[str] = []

    async def connect(self, version: str, p: PProcess) -> None:
        profile = WireProfile.for_version(spoken(version))
        assert profile is not None
        await self.peer.start()
        ranks = [(0, tp) for tp in range(p.tp)]
        context = zmq.asyncio.Context()
        try:
            replies = await HandshakeClient(context, 5.0).fetch(
                Target("127.0.0.1", "127.0.0.1", p.port), profile, ranks, p.engine_id
            )
        finally:
            context.destroy(linger=0)
        self.agents = [await self.peer.add_remote(replies[rank].agent_metadata) for rank in ranks]

    async def send(self, message: str) -> None:
        for agent in self.agents:
            await self.peer.notify(agent, message.encode())


@pytest.fixture(params=VERSIONS)
async def prefill(request: pytest.FixtureRequest) -> AsyncIterator[tuple[str, PProcess, list[DReader], Any]]:
    """P (TP=2) from the wheel, D's two readers and the sidecar, every handshake done."""
    version: str = request.param
    p = PProcess(fetch_wheel(version), P_TP, 1)
    readers = [DReader(), DReader()]
    sidecar = await releaser(version)
    try:
        for reader in readers:
            await reader.connect(version, p)
        await p.hold(p_request_id(version, "warm"))
        assert await sidecar.release(job(version, p, "warm")) is JobResult.SENT
        await p.await_(lambda: len(p.finished(p_request_id(version, "warm"))) == p.tp, "warm-up freed")
        yield version, p, readers, sidecar
    finally:
        await asyncio.gather(sidecar.close(), *(reader.peer.close() for reader in readers))
        p.stop()


async def freed_after(
    version: str, p: PProcess, readers: list[DReader], sidecar: Any, order: str
) -> int | str:
    """Deliver ``ORDERS[order]`` to every P rank, one message at a time; which one freed it."""
    name = f"dup-{list(ORDERS).index(order)}"
    rid = p_request_id(version, name)
    ranks = sorted((0, tp) for tp in range(p.tp))
    messages = {"D": d_message(spoken(version), rid), "S": sidecar_message(rid)}
    await p.hold(rid, ttl=LEASE)
    freed: int | str | None = None
    pending = iter(readers)
    for index, sender in enumerate(ORDERS[order]):
        arrived = len(p.received(messages[sender]))
        if sender == "D":
            await next(pending).send(messages["D"])
        else:
            assert await sidecar.release(job(version, p, name)) is JobResult.SENT
        await p.await_(lambda m=messages[sender], n=arrived: len(p.received(m)) == n + len(ranks), "arrival")
        await p.settle()
        if freed is None and p.finished(rid) == ranks:
            freed = index
    if freed is None:
        await p.await_(lambda: p.finished(rid) == ranks, "P's lease frees it", within=LEASE + 10)
        assert [m for m in p.logs("Releasing expired KV blocks") if rid in m], "freed by the lease"
        freed = "lease"
    assert p.finished(rid) == ranks  # exactly once per rank, whatever came later
    late = unrecognized(order, freed, len(ranks))
    assert len([m for m in p.logs("unrecognized request") if rid in m]) == late
    return freed


async def test_interleaved_duplicate_notifications(prefill: tuple[str, PProcess, list[DReader], Any]) -> None:
    version, p, readers, sidecar = prefill
    observed = {order: await freed_after(version, p, readers, sidecar, order) for order in ORDERS}
    assert observed == RESULT, f"vLLM {version}"
    assert not [e for e in p.events if "error" in e]
