"""``NixlPeer.notify_many``: NIXL's failures become the retryable ``NixlError`` (fake agents), and
callers are batched on the owner thread (real NIXL agents on loopback; P's workers polled, never
slept on)."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from sidecar.nixl import NixlError
from sidecar.nixl import peer as peer_module
from sidecar.nixl.peer import NixlPeer
from sidecar.release.base import RetryableReleaseError
from tests.support.until import until_async


class BrokenProgress:
    """An agent whose progress call fails (its remotes just went away), and that records sends."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, bytes]] = []

    def get_new_notifs(self) -> dict[str, list[bytes]]:
        raise RuntimeError("NIXL_ERR_BACKEND")

    def send_notif(self, name: str, message: bytes) -> None:
        self.sent.append((name, message))


class Healthy(BrokenProgress):
    def get_new_notifs(self) -> dict[str, list[bytes]]:
        return {}

    def send_notif(self, name: str, message: bytes) -> None:
        if name == "gone":
            raise RuntimeError("NIXL_ERR_NOT_FOUND")
        super().send_notif(name, message)


async def started(agent: BrokenProgress) -> NixlPeer:
    peer = NixlPeer(name="test")
    peer._create = lambda: agent  # type: ignore[method-assign]
    await peer.start()
    return peer


async def test_a_failing_progress_call_is_a_retryable_error_and_sends_nothing() -> None:
    agent = BrokenProgress()
    peer = await started(agent)
    try:
        with pytest.raises(NixlError, match="progress before sending") as caught:
            await peer.notify_many([("p0", b"req:1"), ("p1", b"req:1")])
        assert isinstance(caught.value, RetryableReleaseError)
        assert agent.sent == []
    finally:
        peer._owner.agent = None  # type: ignore[union-attr]  # close() would drive progress
        await peer.close()


async def test_each_send_reports_its_own_result() -> None:
    agent = Healthy()
    peer = await started(agent)
    try:
        results = await peer.notify_many([("p0", b"a:1"), ("gone", b"a:1"), ("p1", b"a:1")])
        assert results[0] is None and results[2] is None
        assert results[1] is not None and "NIXL_ERR_NOT_FOUND" in results[1]
        assert agent.sent == [("p0", b"a:1"), ("p1", b"a:1")]
    finally:
        await peer.close()


def test_progress_is_fast_after_a_send_then_slow_then_stops() -> None:
    """A P slow to finish UCX's wire-up (a loaded node) still gets the message: after the fast
    window the owner thread keeps driving progress, slowly, until P's lease would have run out."""
    from sidecar.nixl import owner as peer

    owner = peer.Owner()
    try:
        assert owner._tick(time.monotonic()) is None  # nothing sent: sleep until a call
        owner.sent()
        now = time.monotonic()
        assert owner._tick(now) == peer.PROGRESS_TICK
        assert owner._tick(now + peer.PROGRESS_WINDOW) == peer.SLOW_TICK
        assert owner._tick(now + peer.SLOW_WINDOW) is None
    finally:
        owner.stop()


# --- batching, on real NIXL agents (loopback) ---------------------------------------------------


class Counting:
    """A real agent whose progress calls and sends are recorded in order, then made."""

    def __init__(self, agent: Any) -> None:
        self.agent = agent
        self.calls: list[str] = []

    def get_new_notifs(self) -> Any:
        self.calls.append("progress")
        return self.agent.get_new_notifs()

    def send_notif(self, name: str, message: bytes) -> None:
        self.calls.append("send")
        self.agent.send_notif(name, message)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.agent, name)


class RealP:
    """Two P workers' agents (their own progress threads) and what each was notified."""

    def __init__(self) -> None:
        from sidecar.nixl.peer import import_nixl

        api = import_nixl()
        self.agents = [
            api.nixl_agent(str(uuid.uuid4()), api.nixl_agent_config(backends=["UCX"])) for _ in "ab"
        ]
        self.got: list[list[bytes]] = [[] for _ in self.agents]

    async def names(self, peer: NixlPeer) -> list[str]:
        return [await peer.add_remote(agent.get_agent_metadata()) for agent in self.agents]

    async def notified(self, done: Callable[[], bool]) -> None:
        """Collect the workers' notifications until ``done()`` holds."""

        def collected() -> bool:
            for agent, got in zip(self.agents, self.got, strict=True):
                for messages in agent.get_new_notifs().values():
                    got.extend(messages)
            return done()

        await until_async(collected, "P's workers' notifications", poll=0.001, state=lambda: self.got)

    def has(self, message: bytes) -> bool:
        return all(message in got for got in self.got)


@pytest.fixture
async def real() -> AsyncIterator[tuple[NixlPeer, Counting, RealP, list[str]]]:
    peer = NixlPeer()
    await peer.start()
    counting = Counting(peer._agent)
    peer._agent = peer._owner.agent = counting  # type: ignore[union-attr]
    p = RealP()
    names = await p.names(peer)
    try:
        yield peer, counting, p, names
    finally:
        await peer.close()


def hold(peer: NixlPeer) -> threading.Event:
    """Keep the owner thread busy in a call until the returned event is set."""
    gate = threading.Event()
    peer._owner.submit(lambda: gate.wait(30))  # type: ignore[union-attr]
    return gate


@pytest.mark.nixl
async def test_callers_that_ask_meanwhile_go_in_one_batch_with_one_progress_call(real: Any) -> None:
    """50 releases asking while the thread is busy: one hop, one progress call, then 100 sends;
    each worker gets each message exactly once, and progress goes on after the last send."""
    peer, counting, p, names = real
    gate = hold(peer)
    asked = [
        asyncio.create_task(peer.notify_many([(n, f"r{i}:1".encode()) for n in names])) for i in range(50)
    ]
    await asyncio.sleep(0)  # every caller reaches the outbox
    assert len(peer._outbox) == 50
    before, batches = len(counting.calls), peer.batches
    gate.set()
    assert await asyncio.gather(*asked) == [[None, None]] * 50
    assert peer.batches == batches + 1 and peer.batched == 50
    assert counting.calls[before : before + 101] == ["progress"] + ["send"] * 100
    await p.notified(lambda: all(p.has(f"r{i}:1".encode()) for i in range(50)))
    assert all(sorted(got) == sorted(f"r{i}:1".encode() for i in range(50)) for got in p.got)
    sent = len(counting.calls)
    await p.notified(lambda: len(counting.calls) > sent)  # the window: UCX keeps progressing
    assert counting.calls[sent:] == ["progress"] * (len(counting.calls) - sent)


@pytest.mark.nixl
async def test_in_the_fast_window_the_tick_takes_the_outbox_without_waking_the_thread(
    real: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    peer, _, p, names = real
    monkeypatch.setattr(peer_module, "PROGRESS_WINDOW", 60.0)  # a stalled test machine stays in it
    assert await peer.notify_many([(names[0], b"first:1")]) == [None]  # opens the window
    woken: list[object] = []
    submit = peer._owner.submit

    def counted(fn: Callable[[], Any]) -> Any:
        woken.append(fn)
        return submit(fn)

    peer._owner.submit = counted
    assert await peer.notify_many([(n, b"second:1") for n in names]) == [None, None]
    assert woken == []  # taken by a progress tick, no call queued for it
    await p.notified(lambda: p.has(b"second:1"))


@pytest.mark.nixl
async def test_a_caller_cancelled_before_its_batch_ran_sends_nothing(real: Any) -> None:
    peer, _, p, names = real
    gate = hold(peer)
    gone = asyncio.create_task(peer.notify_many([(n, b"gone:1") for n in names]))
    kept = asyncio.create_task(peer.notify_many([(n, b"kept:1") for n in names]))
    await asyncio.sleep(0)
    gone.cancel()
    await asyncio.sleep(0)
    # one step of the loop and the cancellation has reached the call, before the owner thread is free
    # to take it (a wait_for around a shield needed a second step, and the thread sometimes won)
    assert peer._outbox[0][1].cancelled() and not peer._outbox[1][1].done()
    gate.set()
    assert await kept == [None, None]
    assert await peer.notify_many([(n, b"after:1") for n in names]) == [None, None]
    await p.notified(lambda: p.has(b"kept:1") and p.has(b"after:1"))  # in order on each endpoint
    assert not any(b"gone:1" in got for got in p.got)


def test_progress_is_due_a_tick_after_the_last_call_not_after_every_call() -> None:
    from sidecar.nixl import owner as peer

    owner = peer.Owner()
    try:
        assert owner._due(time.monotonic()) is None  # nothing sent
        owner.sent()
        owner.progressed()  # a batch's own progress call
        now = time.monotonic()
        assert 0 < owner._due(now) <= peer.PROGRESS_TICK  # type: ignore[operator]
        assert owner._due(now + peer.PROGRESS_TICK) <= 0  # type: ignore[operator]
        assert owner.ticking()
    finally:
        owner.stop()


class Slow(Healthy):
    """An agent whose sends take ``hold`` seconds (a stuck transport, as the thread sees it)."""

    hold = 0.0

    def send_notif(self, name: str, message: bytes) -> None:
        time.sleep(self.hold)
        super().send_notif(name, message)


async def test_a_slow_call_to_the_agent_is_logged_with_its_name(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(peer_module, "SLOW_CALL", 0.05)
    agent = Slow()
    peer = await started(agent)
    try:
        with caplog.at_level("WARNING", logger="sidecar.nixl.peer"):
            await peer.notify("p0", b"fast:1")
            assert [r for r in caplog.records if r.getMessage() == "NIXL call was slow"] == []
            agent.hold = 0.1
            assert await peer.notify_many([("p0", b"slow:1")]) == [None]
            await peer.notify("p0", b"slow:2")
        slow = [r for r in caplog.records if r.getMessage() == "NIXL call was slow"]
        assert [r.call for r in slow] == ["send_notif", "send_notif"]  # type: ignore[attr-defined]
        assert all(r.seconds >= 0.1 for r in slow)  # type: ignore[attr-defined]
    finally:
        await peer.close()


class Stuck(Healthy):
    """An agent whose ``add_remote_agent`` and sends block until the test lets them go (a call
    stuck in the transport), counting what reaches it."""

    def __init__(self) -> None:
        super().__init__()
        self.go = threading.Event()
        self.entered = threading.Event()
        self.returned = threading.Event()
        self.loaded: list[bytes] = []

    def add_remote_agent(self, metadata: bytes) -> str:
        self.entered.set()
        assert self.go.wait(30), "the test never let the call go"
        self.loaded.append(metadata)
        self.returned.set()
        return "p0"

    def send_notif(self, name: str, message: bytes) -> None:
        self.entered.set()
        assert self.go.wait(30), "the test never let the call go"
        super().send_notif(name, message)


async def started_stuck(monkeypatch: pytest.MonkeyPatch) -> tuple[NixlPeer, list[Stuck], list[str]]:
    """A peer whose first agent gets stuck and whose later ones do not; its replacements noted."""
    monkeypatch.setattr(peer_module, "STUCK_CALL", 0.2)
    agents: list[Stuck] = []

    def create() -> Stuck:
        agent = Stuck()
        if agents:  # only the first agent's calls get stuck
            agent.go.set()
        agents.append(agent)
        return agent

    peer = NixlPeer(name="test")
    peer._create = create  # type: ignore[method-assign]
    replaced: list[str] = []
    peer.on_replaced.append(lambda: replaced.append(peer.name))
    await peer.start()
    return peer, agents, replaced


async def test_a_call_that_does_not_return_replaces_the_agent_and_the_retry_goes_to_the_new_one(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    peer, agents, replaced = await started_stuck(monkeypatch)
    first, first_name, first_owner = agents[0], peer.name, peer._owner
    assert first_owner is not None
    try:
        with pytest.raises(NixlError, match="add_remote_agent did not return") as caught:
            await peer.add_remote(b"meta")
        assert isinstance(caught.value, RetryableReleaseError)
        assert len(agents) == 2
        assert replaced == [peer.name] and peer.name != first_name  # one replacement: P sees a new agent
        lines = [r for r in caplog.records if "replaced" in r.getMessage()]
        assert [r.old_agent for r in lines] == [first_name]  # type: ignore[attr-defined]
        assert await peer.add_remote(b"meta") == "p0"  # the retry, on the new agent
        assert await peer.notify_many([("p0", b"req:1")]) == [None]
        assert agents[1].loaded == [b"meta"] and agents[1].sent == [("p0", b"req:1")]
        first.go.set()  # the stuck call returns at last: its thread ends, nothing else ran there
        assert await asyncio.to_thread(first.returned.wait, 30)
        await asyncio.to_thread(first_owner._thread.join, 30)
        assert not first_owner.alive and first.sent == []
    finally:
        first.go.set()
        await peer.close()


async def test_a_stuck_send_fails_every_waiting_caller_once_and_one_agent_replaces_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    peer, agents, replaced = await started_stuck(monkeypatch)
    first = agents[0]
    try:
        stuck = asyncio.ensure_future(peer.notify_many([("p0", b"a:1")]))
        assert await asyncio.to_thread(first.entered.wait, 30)
        waiting = [asyncio.ensure_future(peer.notify_many([("p0", f"b{i}:1".encode())])) for i in range(3)]
        results = await asyncio.gather(stuck, *waiting, return_exceptions=True)
        assert all(isinstance(r, NixlError) for r in results), results
        assert len(agents) == 2 and len(replaced) == 1  # four callers, one replacement
        assert await peer.notify_many([("p0", b"c:1")]) == [None]
        first.go.set()
        assert agents[1].sent == [("p0", b"c:1")]  # nothing the failed callers asked for went later
    finally:
        first.go.set()
        await peer.close()


async def test_the_session_forgets_the_p_agents_of_a_replaced_agent(monkeypatch: pytest.MonkeyPatch) -> None:
    from prometheus_client import CollectorRegistry

    from sidecar.config import Config
    from sidecar.network.allowlist import Allowlist
    from sidecar.nixl.handshake import PeerSet, TargetCheck
    from sidecar.nixl.metrics import NixlMetrics
    from sidecar.nixl.session import Session

    monkeypatch.setattr(peer_module, "STUCK_CALL", 0.2)
    agents: list[Stuck] = []

    def create() -> Stuck:
        agents.append(Stuck())
        if len(agents) > 1:
            agents[-1].go.set()
        return agents[-1]

    peer = NixlPeer(name="test")
    peer._create = create  # type: ignore[method-assign]
    config = Config(prefill_allow=["127.0.0.1:5600"])
    session = Session(
        config, NixlMetrics(CollectorRegistry()), peer, TargetCheck(Allowlist(config.prefill_allow))
    )
    await session.start()
    try:
        session.cache.put(PeerSet("engine", None, ("127.0.0.1", 5600), {(0, 0): "p0"}))
        assert session.cache.get("engine") is not None
        with pytest.raises(NixlError):
            await peer.add_remote(b"meta")
        assert session.cache.get("engine") is None and len(session.cache) == 0  # handshaken again
    finally:
        agents[0].go.set()
        await session.close()
