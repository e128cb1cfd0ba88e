"""The InferencePool watch against a fake API server on loopback: resume, 410 Gone, a new selector.

The watch (``sidecar.k8s.watch.Watch``) runs with lightkube's real client
against ``tests.support.fake_kube`` over HTTP, with a bearer token. A watch the server
ends is resumed from the last version seen: the changes made meanwhile are
replayed and nothing is listed again. A watch that resumes from a version the
server no longer keeps gets 410 Gone and lists again, so a pod deleted while
no watch was open leaves the allowlist. A pool whose selector changes moves
the allowlist to the pods the new selector matches.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from lightkube import AsyncClient, KubeConfig
from lightkube.config.models import Cluster, User

from sidecar.config import Config
from sidecar.k8s.members import LiveAllowlist, Members
from sidecar.k8s.shared import FILE, Follower, Publisher
from sidecar.k8s.watch import Watch
from sidecar.sim.servers import ServerThread
from tests.support.fake_kube import ALPHA, FakeKube, alpha_pool, inference_pool, pod
from tests.support.until import until_async

TOKEN = "t0ken"
OLD, NEW = {"role": "prefill"}, {"role": "prefill-v2"}
PORT = 8000
ADDRESSES = ("10.0.0.1", "10.0.0.2", "10.0.0.3", "10.0.0.9", "10.0.1.1", "10.0.1.2")  # every pod's


class Running:
    """A started watch, its two allowlists and the fake API behind it."""

    def __init__(self, fake: FakeKube, watch: Watch, prefill: LiveAllowlist, release: LiveAllowlist) -> None:
        self.fake, self.watch, self.prefill, self.release = fake, watch, prefill, release

    def allowed(self) -> set[str]:
        """The pod IPs router mode's P may be (on the pool's target port)."""
        return {ip for ip in ADDRESSES if self.prefill.allows(ip, PORT)}


def _cluster() -> tuple[FakeKube, ServerThread, AsyncClient, Config]:
    """A fake API server (started) holding the pool and one pod, a client of it, and the config
    that names the pool."""
    fake = FakeKube(TOKEN)
    fake.put("inferencepools", inference_pool("pool", OLD, [PORT]))
    fake.put("pods", pod("p-0", "10.0.0.1", OLD))
    server = ServerThread(fake.app()).start()
    kube = KubeConfig.from_one(cluster=Cluster(server=server.url), user=User(token=TOKEN), namespace="llm")
    config = Config(inference_pool="llm/pool", pool_side_channel_ports="5600-5663")
    return fake, server, AsyncClient(config=kube, trust_env=False), config


@pytest.fixture
async def running() -> AsyncIterator[Running]:
    fake, server, client, config = _cluster()
    prefill, release = LiveAllowlist(()), LiveAllowlist(())
    watch = Watch(client, config, prefill, release)
    try:
        await watch.start(5.0)
        assert watch.synced
        yield Running(fake, watch, prefill, release)
    finally:
        await watch.close()
        server.stop()


async def test_a_watch_the_server_ends_is_resumed_from_the_last_version_seen(running: Running) -> None:
    assert running.allowed() == {"10.0.0.1"}
    lists = len(running.fake.list_requests("pods"))
    running.fake.hold()
    running.fake.end_watches()
    running.fake.put("pods", pod("p-1", "10.0.0.2", OLD))  # while no watch is open
    running.fake.release()
    await until_async(lambda: running.allowed() == {"10.0.0.1", "10.0.0.2"})
    assert len(running.fake.list_requests("pods")) == lists, "resumed, not listed again"
    running.fake.delete("pods", "p-0")  # and the resumed watch follows what comes next
    await until_async(lambda: running.allowed() == {"10.0.0.2"})
    assert running.release.allows("10.0.0.2", 5600) and not running.release.allows("10.0.0.1", 5600)


async def test_an_expired_version_410_gone_lists_again(running: Running) -> None:
    lists = len(running.fake.list_requests("pods"))
    running.fake.hold()
    running.fake.end_watches()
    running.fake.delete("pods", "p-0")  # a deletion no watch will ever replay
    running.fake.put("pods", pod("p-1", "10.0.0.2", OLD))
    running.fake.compact()
    running.fake.release()
    await until_async(lambda: running.allowed() == {"10.0.0.2"})
    assert len(running.fake.list_requests("pods")) > lists, "the 410 made the watch list again"
    assert running.watch.synced
    running.fake.put("pods", pod("p-2", "10.0.0.3", OLD))  # and it watches again after the list
    await until_async(lambda: running.allowed() == {"10.0.0.2", "10.0.0.3"})


async def test_a_new_selector_moves_the_allowlist_to_the_pods_it_matches(running: Running) -> None:
    running.fake.put("pods", pod("v2-0", "10.0.1.1", NEW))
    running.fake.put("inferencepools", inference_pool("pool", NEW, [PORT]))
    await until_async(lambda: running.allowed() == {"10.0.1.1"})
    assert running.watch.members.selector == NEW
    running.fake.put("pods", pod("p-9", "10.0.0.9", OLD))  # the old selector's pods stay out
    running.fake.put("pods", pod("v2-1", "10.0.1.2", NEW))
    await until_async(lambda: running.allowed() == {"10.0.1.1", "10.0.1.2"})
    assert any("labelSelector=role%3Dprefill-v2" in u for u in running.fake.list_requests("pods"))


@pytest.mark.parametrize(
    ("pool", "changed", "exists", "selector"),
    [
        (inference_pool("pool", OLD, [PORT]), False, True, OLD),  # the same spec again
        (inference_pool("pool", {**OLD, "tier": "a"}, [PORT]), True, True, {**OLD, "tier": "a"}),
        (inference_pool("pool", NEW, [PORT, 8001]), True, True, NEW),
        (inference_pool("pool", OLD, [8001]), False, True, OLD),  # ports only: same pods
        (None, True, False, {}),  # deleted
    ],
)
def test_apply_pool_says_when_the_selector_changed(
    pool: dict[str, Any] | None, changed: bool, exists: bool, selector: dict[str, str]
) -> None:
    members = Members()
    assert members.apply_pool(inference_pool("pool", OLD, [PORT])) is True  # the first sight
    members.apply_pod("ADDED", pod("p-0", "10.0.0.1", OLD))
    assert members.apply_pool(pool) is changed
    assert (members.exists, members.selector) == (exists, selector)
    ports = [p["number"] for p in pool["spec"]["targetPorts"]] if pool else []
    assert members.entries("5600-5663")[0] == ([f"10.0.0.1:{p}" for p in ports] if exists else [])


async def test_the_older_alpha_group_is_watched_with_its_own_shape() -> None:
    """``--pool-group=inference.networking.x-k8s.io`` (KServe's): v1alpha2, a flat selector and
    ``targetPortNumber``; the watch lists and follows it as it does v1."""
    fake = FakeKube(TOKEN, pool_api=ALPHA)
    fake.put("inferencepools", alpha_pool("pool", OLD, PORT))
    fake.put("pods", pod("p-0", "10.0.0.1", OLD))
    server = ServerThread(fake.app()).start()
    kube = KubeConfig.from_one(cluster=Cluster(server=server.url), user=User(token=TOKEN), namespace="llm")
    config = Config(inference_pool="llm/pool", pool_group="inference.networking.x-k8s.io")
    prefill, release = LiveAllowlist(()), LiveAllowlist(())
    watch = Watch(AsyncClient(config=kube, trust_env=False), config, prefill, release)
    try:
        await watch.start(5.0)
        running = Running(fake, watch, prefill, release)
        assert watch.synced and running.allowed() == {"10.0.0.1"}
        lists = fake.list_requests("inferencepools")
        assert lists and all("/inference.networking.x-k8s.io/v1alpha2/" in u for u in lists)
        fake.put("pods", pod("p-1", "10.0.0.2", OLD))
        await until_async(lambda: running.allowed() == {"10.0.0.1", "10.0.0.2"})
        fake.put("inferencepools", alpha_pool("pool", NEW, PORT))
        await until_async(lambda: running.allowed() == set())
    finally:
        await watch.close()
        server.stop()


async def test_a_publishing_watch_is_followed_and_a_failing_one_keeps_the_lists_last_seen(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The supervisor's watch writes its lists to a file (``sidecar.k8s.shared``); a worker's
    follower enforces them. While the API refuses the watch (401), the file and the follower keep
    the lists last seen, as one process's watch does; once it answers again, changes flow."""
    fake, server, client, config = _cluster()
    publisher = Publisher(tmp_path / FILE)
    watch = Watch(
        client,
        config,
        LiveAllowlist(()),
        LiveAllowlist(()),
        publisher.publish,
    )
    prefill, release = LiveAllowlist(()), LiveAllowlist(())
    follower = Follower(tmp_path / FILE, prefill, release, interval=0.01)
    followed = Running(fake, watch, prefill, release)
    try:
        await watch.start(5.0)
        follower.launch()
        assert follower.synced and followed.allowed() == {"10.0.0.1"} and release.allows("10.0.0.1", 5600)
        fake.put("pods", pod("p-1", "10.0.0.2", OLD))
        await until_async(lambda: followed.allowed() == {"10.0.0.1", "10.0.0.2"})
        version = publisher.version
        with caplog.at_level(logging.WARNING, "sidecar.k8s"):
            fake.token = "revoked"
            fake.end_watches()
            await until_async(lambda: "Kubernetes watch failed" in caplog.text)
        assert publisher.version == version and follower.synced
        assert followed.allowed() == {"10.0.0.1", "10.0.0.2"}
        fake.token = TOKEN
        fake.delete("pods", "p-0")
        await until_async(lambda: followed.allowed() == {"10.0.0.2"}, timeout=15.0)
        assert follower.synced
    finally:
        await follower.close()
        await watch.close()
        server.stop()
