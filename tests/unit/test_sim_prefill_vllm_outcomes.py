"""The prefill simulator against vLLM's own P: the same outcome for every notification order.

``tests/conformance/test_vllm_duplicates.py`` ran vLLM's P code from the
wheels and recorded, per order of D's two readers' notifications and the
sidecar's, which message freed the request on every P rank, or that only P's
lease did (``RESULT`` in ``tests/conformance/duplicate_orders.py``). The
fault tests take the simulator's ``/stats`` as ground truth
(``tests/faults/invariants.py``), so the simulator's ``BlockPool`` must reach
the same result, log the same number of unrecognized ids and finish each rank
exactly once. No NIXL and no vLLM here: the pool is driven message by message,
as P's step loop consumes them, on a fake clock.
"""

from __future__ import annotations

import pytest

from sidecar.sim.prefill.pool import BlockPool
from sidecar.sim.prefill.release import release_for
from tests.conformance.duplicate_orders import (
    ALSO_MATCHED,
    ORDERS,
    P_TP,
    RECORDED,
    RESULT,
    d_message,
    sidecar_message,
    unrecognized,
)

LEASE = 3.0


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def freed_after(version: str, order: str) -> tuple[int | str, dict[str, object]]:
    """Deliver ``ORDERS[order]`` to every simulated P rank; which message freed the request."""
    clock = Clock()
    pool = BlockPool(release_for(version), num_blocks=8, tp=P_TP, pp=1, lease=LEASE, clock=clock)
    rid = "cmpl-dup-0"
    pool.pin(rid, pool.allocate(rid, 3))
    messages = {"D": d_message(version, rid), "S": sidecar_message(rid)}
    freed: int | str | None = None
    for index, sender in enumerate(ORDERS[order]):
        for rank in range(P_TP):
            pool.on_notification(rank, messages[sender].encode())
            pool.reap(rank)  # P's step loop checks expiry after each batch of notifications
        if freed is None and pool.describe(rid)["pinned"] is False:  # type: ignore[index]
            freed = index
    if freed is None:
        assert pool.stats()["pinned_requests"] == 1
        clock.now += LEASE
        for rank in range(P_TP):
            pool.reap(rank)
        freed = "lease"
    return freed, pool.stats()


@pytest.mark.parametrize("version", RECORDED + ALSO_MATCHED)
@pytest.mark.parametrize("order", list(ORDERS))
def test_the_simulator_frees_after_the_message_vllm_freed_after(version: str, order: str) -> None:
    freed, stats = freed_after(version, order)
    assert freed == RESULT[order], f"vLLM {version}, {order}"
    assert stats["pinned_requests"] == 0 and stats["blocks_in_use"] == 0
    # Exactly once per rank, whatever came later; then every later message is an unknown id.
    by_notification, by_expiry = stats["rank_finished_by_notification"], stats["rank_finished_by_expiry"]
    assert by_expiry == ([1] * P_TP if freed == "lease" else [0] * P_TP)
    assert by_notification == ([0] * P_TP if freed == "lease" else [1] * P_TP)
    assert stats["notifs_unknown"] == unrecognized(order, freed, P_TP)
    assert stats["notifs_malformed"] == 0 and stats["worker_errors"] == 0
    assert (stats["freed_by_expiry"], stats["freed_by_notification"]) == (
        (1, 0) if freed == "lease" else (0, 1)
    )
