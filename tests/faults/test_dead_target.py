"""A dead P never delays a live P's releases, and costs a bounded number of connection attempts.

The scenario a P pod dying during a burst of rejections creates: 40 rejected
requests name a P side channel where nothing listens (another engine, an
allowlisted address), then 5 more a second keep coming, while real rejections
name the live P (the simulator at TP 2). The sidecar runs its default 32
workers. Expected:

* every real release reaches P at once: P frees each within 100 ms of D's
  answer reaching the client (an upper bound computed from P's own record);
* the dead target's breaker opens after three refused connections; from then
  on its jobs wait without a worker and only a probe connects, at growing
  intervals (at most one per ``FRESH_GAP`` while new rejections name it), so
  the attempts stay bounded by time whatever the number of jobs;
* each job ends with exactly one "release decision" line: ``failed`` for the
  dead ones at their deadline, ``sent`` for the real ones.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from sidecar.release.pipeline import FRESH_GAP
from tests.faults.cluster import Backends, Sent, scene
from tests.support.ports import free_port
from tests.support.until import until

pytestmark = pytest.mark.nixl

DEADLINE = 4.0
STEADY_SECONDS = 4.0
#: Three failures open the breaker; probes follow at 0.5, 1, 2, 4 s intervals while jobs keep it
#: in use (about 8 s here), and each new rejection naming the dead P brings a probe forward to
#: FRESH_GAP after the last failure (at most one per FRESH_GAP while they keep coming, for
#: STEADY_SECONDS): at most 3 + 4 + 8, plus a few for timing, whatever the number of jobs.
ATTEMPTS_BOUND = 3 + 4 + int(STEADY_SECONDS / FRESH_GAP) + 3


def _dead_params(template: dict[str, Any], port: int, index: int) -> dict[str, Any]:
    """Parameters of a P engine that died: its side channel refuses every connection."""
    return {
        **template,
        "remote_engine_id": "dead-engine",
        "remote_request_id": f"dead-p-request-{index}",
        "remote_port": port,
    }


def test_a_dead_p_never_delays_a_live_ones_releases(cluster: Backends) -> None:
    with scene(cluster, cluster.d.url, "dead-p", release_deadline=DEADLINE, release_workers=32) as s:
        warm = s.flows.decode(s.sc.url, "reject")  # the live P's handshake, cached from here on
        until(lambda: s.sample("kvr_releases_total", strategy="nixl", result="sent") == 1, "warm-up release")
        dead_port = free_port()
        template = warm.params
        dead: list[Sent] = []
        for i in range(40):
            dead.append(
                s.flows.decode(
                    s.sc.url, "reject", pinned=(s.flows.next_id(), _dead_params(template, dead_port, i))
                )
            )
        real: list[tuple[Sent, float, float]] = []  # (sent, pinned by, answered at)
        started = time.monotonic()
        index, next_dead, next_real = 40, started, started
        while time.monotonic() - started < STEADY_SECONDS:  # 5 dead and 2 real rejections a second
            now = time.monotonic()
            if now >= next_dead:
                params = _dead_params(template, dead_port, index)
                dead.append(s.flows.decode(s.sc.url, "reject", pinned=(s.flows.next_id(), params)))
                index, next_dead = index + 1, next_dead + 0.2
            if now >= next_real:
                pinned = s.flows.pin()
                pinned_by = time.monotonic()
                sent = s.flows.decode(s.sc.url, "reject", pinned=pinned)
                real.append((sent, pinned_by, time.monotonic()))
                next_real += 0.5
            time.sleep(max(0.0, min(next_dead, next_real) - time.monotonic()))
        assert all(x.status == 400 and not x.sidecar_answered for x in dead)
        assert all(x.status == 400 for x, _, _ in real)

        def freed_within() -> list[float]:
            latencies = []
            for sent, pinned_by, answered in real:
                record = s.checker.truth.p_record(sent.p_request_id)
                assert record is not None
                if record["freed_by"] != "notification":
                    return []
                latencies.append(pinned_by + record["held_seconds"] - answered)
            return latencies

        until(lambda: bool(freed_within()), "every real release freed at P", timeout=5)
        latencies = sorted(freed_within())
        assert latencies[-1] < 0.1, f"slowest real release freed {latencies[-1]:.3f} s after D's answer"

        dead_ids = [x.request_id for x in dead]
        until(
            lambda: all(s.watch.decisions.get(rid) for rid in dead_ids),
            "every dead job decided at its deadline",
            timeout=DEADLINE + 5,
        )
        attempts = s.sample("kvr_release_attempts_total", strategy="nixl", reason="unreachable")
        assert 3 <= attempts <= ATTEMPTS_BOUND, attempts
        assert s.sample("kvr_release_attempts_total", strategy="nixl", reason="target_down") >= len(dead) - 3
        # One decision line per job, whatever the number of attempts.
        assert all(s.watch.decisions[rid] == ["failed"] for rid in dead_ids)
        assert all(s.watch.decisions[x.request_id] == ["sent"] for x, _, _ in real)
        assert s.watch.decisions[warm.request_id] == ["sent"]
        s.check([s.observe(warm, "sidecar"), *(s.observe(x, "sidecar") for x, _, _ in real)])
        print(
            f"\ndead target: {len(dead)} jobs, {attempts:.0f} connection attempts; "
            f"{len(real)} real releases freed at P within {latencies[-1] * 1000:.1f} ms (max) of D's answer"
        )
