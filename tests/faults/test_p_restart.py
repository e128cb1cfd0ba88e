"""A P that restarts at the same address is a new P; one that comes back is used at once.

P (the prefill simulator, vLLM 0.34.0, TP 2) is stopped and started again on
the same side-channel port, with the same engine id (an operator's
``--engine-id``) or a new one. Its NIXL agents get new names: that is what
tells the sidecar the process is new. Requests prefilled by the old P and
rejected by D while it was down are refused (``p_restarted``, or
``engine_mismatch`` when the engine id changed), never sent to the new P,
which therefore sees no notification for an id it never held. A request the
new P prefilled is released as soon as the sidecar's first handshake with it
succeeds (measured against the time P served that handshake), even though
the target's breaker was open with a long interval.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest

from sidecar.release.pipeline import BreakerPolicy
from sidecar.sim.prefill import PrefillSimConfig, create_prefill_app
from sidecar.sim.servers import ServerThread, serve
from tests.faults.cluster import MODEL, TP, VERSION, Backends, Flows, Sent, sidecar
from tests.support.runner import Sidecar
from tests.support.until import until

pytestmark = pytest.mark.nixl

OLD = 4  # requests the old P prefilled, rejected while it is down


@contextmanager
def prefill(engine_id: str, side_channel_port: int = 0) -> Iterator[ServerThread]:
    config = PrefillSimConfig(
        port=0,
        vllm_version=VERSION,
        tp=TP,
        num_blocks=1024,
        lease=0,
        side_channel_port=side_channel_port,
        model=MODEL,
        engine_id=engine_id,
        log_level="warning",
    )
    with serve(create_prefill_app(config)) as p:
        yield p


def _stats(p: ServerThread) -> dict[str, Any]:
    return dict(httpx.get(p.url + "/stats", timeout=5).json())


def _record(p: ServerThread, sent: Sent) -> dict[str, Any] | None:
    response = httpx.get(f"{p.url}/sim/requests/{sent.p_request_id}", timeout=5)
    return dict(response.json()) if response.status_code == 200 else None


def _refused(sc: Sidecar, reason: str) -> float:
    return sc.sample("kvr_nixl_refused_total", reason=reason)


@contextmanager
def _flows(cluster: Backends, p: ServerThread) -> Iterator[Flows]:
    """Flows whose prefill leg goes to ``p`` (the cluster's D rejects their decode legs)."""
    flows = Flows(Backends(p, cluster.d, cluster.d_app), "restart")
    try:
        yield flows
    finally:
        flows.close()


@pytest.mark.parametrize("new_engine", [False, True], ids=["same-engine-id", "new-engine-id"])
def test_a_restarted_p_gets_nothing_meant_for_the_old_one(cluster: Backends, new_engine: bool) -> None:
    with sidecar(cluster.d.url) as sc:
        runtime = sc.app.runtime
        assert runtime is not None
        # An open breaker waits a minute before its own probe: only a request the new P prefilled
        # can bring the probe forward within this test (targets take the policy when first named).
        runtime.pipeline.targets._policy = BreakerPolicy(failures=3, interval=60.0, max_interval=60.0)
        with prefill("p-restart") as old_p, _flows(cluster, old_p) as flows:
            port = int(_stats(old_p)["side_channel_port"])
            warm = flows.decode(sc.url, "reject")
            until(lambda: (_record(old_p, warm) or {}).get("freed_by") == "notification", "warm release")
            pinned = [flows.pin() for _ in range(OLD)]
        # The old P is gone: its requests' rejections arrive, and their releases find nobody.
        with _flows(cluster, old_p) as flows:
            old = [flows.decode(sc.url, "reject", pinned=item) for item in pinned]
        until(lambda: runtime.pipeline.live == OLD, "the old requests' jobs")
        made = max(live.job.detected_at for live in runtime.pipeline._jobs.values())
        target = runtime.pipeline.targets.get(f"127.0.0.1:{port}")
        # An old job made after a failure still probes (P may be back); once a probe failed after
        # the last of them was made, the breaker holds them all for its interval.
        until(lambda: target.state.value == "open" and target._failed_at > made, "old jobs held")
        lost = time.monotonic()
        engine = "p-restart-2" if new_engine else "p-restart"
        with prefill(engine, side_channel_port=port) as new_p:
            # The old requests were rejected before P was found gone: never the new P's.
            until(lambda: time.monotonic() > lost + 1.0, "the restart grace after P was found gone")
            assert _stats(new_p)["handshakes_served"] == 0  # the breaker is open: nobody tried yet
            sent = time.monotonic()
            with _flows(cluster, new_p) as new_flows:
                fresh = new_flows.decode(sc.url, "reject")
            until(lambda: (_record(new_p, fresh) or {}).get("freed_by") == "notification", "fresh release")
            stats, record = _stats(new_p), _record(new_p, fresh)
            assert record is not None and record["notification_counts"] == [1] * TP
            # The fresh request's job probed at once: the new P served its first handshake after the
            # fresh request was sent, the release followed it, and both came long before the
            # breaker's own probe (a minute away; 30 s is the bound, the rest the loaded machine's).
            assert sent <= stats["first_handshake_at"] <= record["freed_at"] < sent + 30.0
            reason = "engine_mismatch" if new_engine else "p_restarted"
            until(lambda: _refused(sc, reason) == OLD, f"the old requests refused ({reason})", timeout=15)
            assert sc.wait_idle(10)
            assert _stats(new_p)["notifs_unknown"] == 0  # nothing old reached the new P
            assert sc.sample("kvr_releases_total", strategy="nixl", result="sent") == 2  # warm, fresh
        assert all(x.status == 400 for x in [warm, *old, fresh])
