"""``NixlPeer.notify_many`` on a fake agent: NIXL's failures become the retryable ``NixlError``."""

from __future__ import annotations

import time

import pytest

from sidecar.nixl import NixlError
from sidecar.nixl.peer import NixlPeer
from sidecar.release.base import RetryableReleaseError


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
    from sidecar.nixl import peer

    owner = peer._Owner()
    try:
        assert owner._tick(time.monotonic()) is None  # nothing sent: sleep until a call
        owner.sent()
        now = time.monotonic()
        assert owner._tick(now) == peer.PROGRESS_TICK
        assert owner._tick(now + peer.PROGRESS_WINDOW) == peer.SLOW_TICK
        assert owner._tick(now + peer.SLOW_WINDOW) is None
    finally:
        owner.stop()
