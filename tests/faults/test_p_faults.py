"""Faults on the prefill side: P down, slow, restarted, its listener garbled or silent, a storm.

D is reachable; the rejected requests' ``kv_transfer_params`` name P's side
channel through a ``FaultGate`` (``via``), so the gate sits between the
decode pod and P. The requests are rejected by D's request validation (400,
before its handler), so releasing them is the sidecar's job alone. Every
scenario ends with the full invariant check (``tests/faults/invariants.py``).
"""

from __future__ import annotations

import time

import httpx
import pytest

from tests.faults.cluster import Backends, Scene, Sent, scene
from tests.faults.gate import fault_gate
from tests.faults.invariants import BoundsSampler
from tests.support.until import until

pytestmark = pytest.mark.nixl


def _errors(s: Scene, reason: str) -> float:
    return s.sample("kvr_nixl_errors_total", reason=reason)


def _rejected_quickly(sent: list[Sent], within: float = 1.0) -> None:
    """D's own 400 reached the client, without waiting for any release."""
    assert [x.status for x in sent] == [400] * len(sent)
    assert not any(x.sidecar_answered for x in sent)
    assert max(x.seconds for x in sent) < within, [round(x.seconds, 3) for x in sent]


def test_p_down_then_back(cluster: Backends) -> None:
    """P's side channel refuses connections past one batch's deadline, and comes back within the next's.

    The sidecar has never reached P (no cached handshake), so every release
    needs the side channel. Expected: the client always gets D's 400 at once.
    While P is down the release is retried (``kvr_nixl_errors_total
    {reason="unreachable"}``). The first batch's deadline (2 s) passes: its jobs
    end ``kvr_releases_total{result="failed"}``, nothing is sent, P still holds
    the blocks (its lease frees them). P comes back before the second batch's
    deadline: released once each, freed by notification.
    """
    with (
        fault_gate(cluster.side_channel_port) as gate,
        scene(cluster, cluster.d.url, "p-down", release_deadline=2.0) as s,
    ):
        gate.set("down")
        late = [s.flows.decode(s.sc.url, "reject", gate=gate) for _ in range(2)]
        until(lambda: s.sample("kvr_releases_total", strategy="nixl", result="failed") == 2, "deadline")
        refused = _errors(s, "unreachable")
        early = [s.flows.decode(s.sc.url, "reject", gate=gate) for _ in range(2)]
        until(lambda: _errors(s, "unreachable") >= refused + 2, "retries against a P that is down")
        gate.set("pass")
        _rejected_quickly(late + early)
        s.check(
            [
                *(s.observe(x, "sidecar", reachable=False) for x in late),
                *(s.observe(x, "sidecar") for x in early),
            ]
        )
        assert s.sample("kvr_releases_total", strategy="nixl", result="sent") == 2


def test_p_slow_to_handshake(cluster: Backends) -> None:
    """P's side channel answers slower than ``handshake_timeout`` (1 s), then merely slowly.

    Expected: D's 400 at once; handshakes time out and are retried
    (``reason="handshake_timeout"``); once P answers within the timeout the
    release goes through once per request. P's listener, which answered REQ
    sockets the sidecar had already closed, is still alive.
    """
    with fault_gate(cluster.side_channel_port) as gate, scene(cluster, cluster.d.url, "p-slow") as s:
        gate.set("delay", delay=1.5)
        slow = [s.flows.decode(s.sc.url, "reject", gate=gate) for _ in range(2)]
        until(lambda: _errors(s, "handshake_timeout") >= 2, "handshake timeouts", timeout=15)
        gate.set("delay", delay=0.05)
        report = s.check([s.observe(x, "sidecar") for x in slow])
        _rejected_quickly(slow)
        assert gate.stats["delayed_chunks"] > 0
        assert report.decisions == {"sent": 2}


def _idle(s: Scene) -> bool:
    """The sidecar's NIXL thread left its fast progress window after a send (it then only drives
    progress every ``SLOW_TICK``)."""
    runtime = s.sc.app.runtime
    assert runtime is not None
    owner = runtime.releaser.peer._owner  # type: ignore[attr-defined]
    return bool(owner._progress_until < time.monotonic())


@pytest.mark.parametrize(
    "idle",
    [False, True],
    ids=["restart-while-progressing", "restart-while-idle"],
)
def test_p_restarted_with_new_agents(cluster: Backends, idle: bool) -> None:
    """P replaces its NIXL agents (new names, generation + 1) between two releases.

    Expected: D's 400 at once for every request. A request pinned before the
    restart (generation 0) and one after (generation 1) are both released once:
    a send to the old, cached agents fails and the sidecar handshakes again
    (``kvr_nixl_handshake_cache_evictions_total``). A fresh D handshakes the new
    agents. ``idle``: the restart happens after the sidecar's NIXL thread went
    quiet (more than ``PROGRESS_WINDOW`` after its last send).
    """
    with scene(cluster, cluster.d.url, "p-restart") as s:
        warm = s.flows.decode(s.sc.url, "reject")
        until(lambda: s.sample("kvr_releases_total", strategy="nixl", result="sent") == 1, "warm release")
        old = s.flows.pin()
        if idle:
            until(lambda: _idle(s), "the sidecar's NIXL thread to go idle")
        assert httpx.post(cluster.p.url + "/sim/restart-agents").status_code == 200
        if idle:
            until(lambda: _idle(s), "still idle after the restart")
        before = s.flows.decode(s.sc.url, "reject", pinned=old)
        after = s.flows.decode(s.sc.url, "reject")
        admitted = s.flows.decode(s.sc.url, "admit")
        _rejected_quickly([warm, before, after])
        assert admitted.status == 200
        observed = [s.observe(x, "sidecar") for x in (warm, before, after)] + [s.observe(admitted, "d")]
        s.check(observed, timeout=3.0)
        assert s.sample("kvr_nixl_handshakes_total", result="ok") >= 2


def test_p_listener_answers_garbage(cluster: Backends) -> None:
    """Something that is not P's ZMQ listener answers garbage on the side-channel port, then P is back.

    Expected: D's 400 at once; the handshake fails and is retried (no NIXL
    agent is added from garbage); once P answers, released once. P's real
    listener never saw a malformed handshake and is alive.
    """
    with fault_gate(cluster.side_channel_port) as gate, scene(cluster, cluster.d.url, "p-garbage") as s:
        gate.set("garbage")
        sent = [s.flows.decode(s.sc.url, "reject", gate=gate) for _ in range(2)]
        until(lambda: gate.stats["accepted_garbage"] >= 3, "handshakes against garbage")
        gate.set("pass")
        s.check([s.observe(x, "sidecar") for x in sent])
        _rejected_quickly(sent)
        failures = sum(_errors(s, r) for r in ("unreachable", "bad_reply", "handshake_timeout"))
        assert failures >= 2


def test_p_listener_answers_nothing(cluster: Backends) -> None:
    """P's side-channel port accepts connections and never answers, then P is back.

    Expected: D's 400 at once; handshakes time out (``handshake_timeout``) and
    are retried; once P answers, released once.
    """
    with fault_gate(cluster.side_channel_port) as gate, scene(cluster, cluster.d.url, "p-silent") as s:
        gate.set("blackhole")
        sent = [s.flows.decode(s.sc.url, "reject", gate=gate) for _ in range(2)]
        until(lambda: _errors(s, "handshake_timeout") >= 2, "handshake timeouts")
        gate.set("pass")
        s.check([s.observe(x, "sidecar") for x in sent])
        _rejected_quickly(sent)


def test_rejection_storm_overflows_the_queue(cluster: Backends) -> None:
    """40 rejections while the one release worker is stuck on a silent P; queue of 4.

    Expected: every client gets D's 400 at once (no request waits on the
    queue). The queue never holds more than 4 jobs; the oldest are dropped:
    exactly 35 ``kvr_releases_total{result="dropped"}`` (40 - 1 running - 4
    queued), requests 2-36. Once P answers, the running job and the 4 newest
    are released once each; the dropped ones stay pinned on P (its lease).
    """
    # The running job holds the worker while its handshake waits on the silent P: 5 s, for the 40
    # requests to arrive on a loaded machine (with 1 s it timed out mid-storm, went back to wait
    # for a retry, and was dropped as the oldest).
    settings = {
        "release_queue_size": 4,
        "release_workers": 1,
        "release_deadline": 20.0,
        "handshake_timeout": 5.0,
    }
    with (
        fault_gate(cluster.side_channel_port) as gate,
        scene(cluster, cluster.d.url, "storm", **settings) as s,
    ):
        gate.set("blackhole")
        sampler = BoundsSampler(s.view)
        with sampler.running():
            storm = [s.flows.decode(s.sc.url, "reject", gate=gate) for _ in range(40)]
            assert s.sample("kvr_releases_total", strategy="nixl", result="dropped") == 35
            gate.set("pass")
            report = s.checker.check(
                [s.observe(x, "sidecar", may_drop=True) for x in storm], peaks=sampler.peaks
            )
        report.verify()
        _rejected_quickly(storm)
        decisions = s.view.decisions()
        released = [i for i, x in enumerate(storm) if decisions[x.request_id] == ["sent"]]
        assert released == [0, 36, 37, 38, 39]
        assert sampler.peaks["kvr_release_queue_depth"] == 4


def test_partition_between_sidecar_and_p_tcp_blackhole(cluster: Backends) -> None:
    """A partition between the decode pod and P's side channel, emulated by a TCP blackhole.

    The gate swallows every byte both ways, on open relays and new ones (a
    real partition is the netns variant, ``test_partition_netns.py``; this one
    cannot cut NIXL's own UCX traffic, so it partitions handshakes only).
    P first serves a warm handshake; then P re-registers its agents, so the
    next releases must handshake through the partition.

    Expected: D's 400 at once for all. Released once: the warm one, and the
    ones pinned after the re-registration whose deadline (3 s) outlives the
    partition. One whose deadline passes inside the partition fails
    (``result="failed"``) and stays pinned on P. (One job per batch in the
    partition: two jobs sharing a handshake at a deadline hit the bug
    ``test_a_job_waiting_on_an_abandoned_handshake_survives`` pins down.)
    """
    with (
        fault_gate(cluster.side_channel_port) as gate,
        scene(cluster, cluster.d.url, "partition", release_deadline=3.0) as s,
    ):
        warm = s.flows.decode(s.sc.url, "reject", gate=gate)
        until(lambda: s.sample("kvr_releases_total", strategy="nixl", result="sent") == 1, "warm release")
        assert httpx.post(cluster.p.url + "/sim/restart-agents").status_code == 200
        gate.set("blackhole")
        lost = s.flows.decode(s.sc.url, "reject", gate=gate)
        until(
            lambda: s.sample("kvr_releases_total", strategy="nixl", result="failed") == 1,
            "deadline",
            10,
            state=s.releases,
        )
        healed = s.flows.decode(s.sc.url, "reject", gate=gate)
        until(lambda: _errors(s, "handshake_timeout") >= 3, "handshakes into the partition")
        gate.set("pass")
        _rejected_quickly([warm, lost, healed])
        s.check(
            [
                s.observe(warm, "sidecar"),
                s.observe(lost, "sidecar", reachable=False),
                s.observe(healed, "sidecar"),
            ]
        )


def test_a_job_waiting_on_an_abandoned_handshake_survives(cluster: Backends) -> None:
    """Two rejections for one silent P; the second joins the first's handshake, which its deadline ends.

    ``handshake_timeout`` (5 s) outlives ``release_deadline`` (1 s), so the
    first job's deadline cancels the handshake the second one waits on.
    Expected: both jobs end ``failed`` (accounted once each), none is left
    undecided, and once P answers a new rejection is released.
    """
    settings = {"release_deadline": 1.0, "handshake_timeout": 5.0}
    with (
        fault_gate(cluster.side_channel_port) as gate,
        scene(cluster, cluster.d.url, "abandon", **settings) as s,
    ):
        gate.set("blackhole")
        first = s.flows.decode(s.sc.url, "reject", gate=gate)
        until(lambda: gate.stats["accepted_blackhole"] >= 1, "the first job's handshake")
        second = s.flows.decode(s.sc.url, "reject", gate=gate)
        # P stays silent until both jobs ended (failed at their deadlines).
        until(
            lambda: s.sample("kvr_releases_total", strategy="nixl", result="failed") == 2,
            "both deadlines",
            state=s.releases,
        )
        assert s.view.internals()["live_jobs"] == 0
        gate.set("pass")
        after = s.flows.decode(s.sc.url, "reject", gate=gate)
        s.check(
            [
                s.observe(first, "sidecar", reachable=False),
                s.observe(second, "sidecar", reachable=False),
                s.observe(after, "sidecar"),
            ],
            timeout=2,
        )


def test_gate_is_hit(cluster: Backends) -> None:
    """The P-side gate really is on the path: with it down, no handshake reaches P."""
    with fault_gate(cluster.side_channel_port) as gate, scene(cluster, cluster.d.url, "gate") as s:
        served = httpx.get(cluster.p.url + "/stats").json()["handshakes_served"]
        gate.set("down")
        sent = s.flows.decode(s.sc.url, "reject", gate=gate)
        until(lambda: _errors(s, "unreachable") >= 1, "a refused handshake")
        assert httpx.get(cluster.p.url + "/stats").json()["handshakes_served"] == served
        gate.set("pass")
        s.check([s.observe(sent, "sidecar")])
        assert httpx.get(cluster.p.url + "/stats").json()["handshakes_served"] > served
