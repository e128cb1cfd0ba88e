"""The in-flight veto as a table: which parameters D may still be reading.

``InFlight`` counts the requests with the same parameters that are at D, and
remembers for its ``ttl`` those D admitted (or is aborting). The judge asks
``may_be_read`` before every release; these are its answers, step by step.
"""

from __future__ import annotations

from sidecar.decision.judge import InFlight

KEY, OTHER = ("p-engine", "cmpl-r1"), ("p-engine", "cmpl-r2")


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def inflight(ttl: float = 30.0) -> tuple[InFlight, Clock]:
    clock = Clock()
    return InFlight(64, ttl, clock), clock


def test_parameters_at_d_may_be_read_until_their_request_is_judged() -> None:
    known, _ = inflight()
    assert not known.may_be_read(KEY)
    known.forwarded(KEY)
    assert known.may_be_read(KEY) and not known.may_be_read(OTHER)
    known.finished(KEY, admitted=False)
    assert not known.may_be_read(KEY)


def test_each_copy_at_d_counts_until_the_last_one_is_judged() -> None:
    known, _ = inflight()
    for _ in range(3):
        known.forwarded(KEY)
    known.finished(KEY, admitted=False)
    assert known.may_be_read(KEY)  # two more still at D
    known.finished(KEY, admitted=False)
    assert known.may_be_read(KEY)  # one more
    known.finished(KEY, admitted=False)
    assert not known.may_be_read(KEY)
    known.forwarded(KEY)  # the count starts again from nothing
    assert known.may_be_read(KEY)
    known.finished(KEY, admitted=False)
    assert not known.may_be_read(KEY)


def test_a_finish_without_a_forward_leaves_nothing_behind() -> None:
    known, _ = inflight()
    known.finished(KEY, admitted=False)  # judged before it was forwarded (refused on the way)
    assert not known.may_be_read(KEY)
    known.forwarded(KEY)
    assert known.may_be_read(KEY)  # a later forward is counted from zero, not from -1
    known.finished(KEY, admitted=False)
    assert not known.may_be_read(KEY)


def test_admitted_parameters_may_be_read_for_the_lease_then_not() -> None:
    known, clock = inflight(ttl=30.0)
    known.forwarded(KEY)
    known.finished(KEY, admitted=True)
    assert known.may_be_read(KEY) and not known.may_be_read(OTHER)
    clock.now += 29.0
    assert known.may_be_read(KEY)
    clock.now += 2.0
    assert not known.may_be_read(KEY)  # the lease the sidecar assumes has run out


def test_an_abort_marks_the_parameters_read_without_a_forward() -> None:
    known, clock = inflight(ttl=5.0)
    known.admitted(KEY)
    assert known.may_be_read(KEY)
    clock.now += 6.0
    assert not known.may_be_read(KEY)


def test_judged_requests_leave_no_count_behind() -> None:
    """One count per key at D, none once judged: the table stays as small as the traffic at D."""
    known, _ = inflight()
    for n in range(50):
        known.forwarded(("p-engine", f"cmpl-{n}"))
        known.finished(("p-engine", f"cmpl-{n}"), admitted=False)
    assert known._live == {}  # the only view of the table's size


def test_the_admitted_table_keeps_at_most_its_size_the_oldest_going_first() -> None:
    clock = Clock()
    known = InFlight(2, 30.0, clock)
    keys = [("p-engine", f"cmpl-{n}") for n in range(3)]
    for key in keys:
        known.admitted(key)
    assert not known.may_be_read(keys[0])  # the least recently set went
    assert known.may_be_read(keys[1]) and known.may_be_read(keys[2])
    known.admitted(keys[1])  # set again: now the newest
    known.admitted(("p-engine", "cmpl-3"))
    assert known.may_be_read(keys[1]) and not known.may_be_read(keys[2])
    assert len(known._admitted) == 2


def test_expired_admissions_are_dropped_as_new_ones_come() -> None:
    known, clock = inflight(ttl=5.0)
    for n in range(10):
        known.admitted(("p-engine", f"old-{n}"))
    clock.now += 6.0
    for n in range(10):
        known.admitted(("p-engine", f"new-{n}"))
    assert set(known._admitted) == {("p-engine", f"new-{n}") for n in range(10)}
    assert all(known.may_be_read(("p-engine", f"new-{n}")) for n in range(10))


def test_admitted_parameters_are_no_longer_read_at_the_lease_s_exact_end() -> None:
    # As the TTLMap it replaced (cachetools: an entry is in while the clock is before its expiry).
    known, clock = inflight(ttl=30.0)
    known.admitted(KEY)
    clock.now += 30.0
    assert not known.may_be_read(KEY)
