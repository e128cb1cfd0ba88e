"""The one bounded map with expiry (``sidecar.ttlmap``) and the tables built on it."""

from __future__ import annotations

from sidecar.decision.judge import InFlight
from sidecar.nixl.handshake import HandshakeCache, PeerSet
from sidecar.release.ledger import Ledger
from sidecar.ttlmap import TTLMap


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def peers(engine_id: str) -> PeerSet:
    return PeerSet(engine_id, None, ("10.0.0.1", 5600), {(0, 0): f"agent-{engine_id}"})


def test_entries_expire_after_their_ttl_and_the_least_recently_set_go_first() -> None:
    clock = Clock()
    table: TTLMap[str, int] = TTLMap(2, 10.0, clock, keep_dropped=True)
    table["a"], table["b"] = 1, 2
    table["c"] = 3  # full: "a" goes
    assert "a" not in table and table.take_dropped() == [("a", 1)]
    clock.now += 10.0
    assert "b" not in table and "c" not in table  # expired, still held until expire()
    assert sorted(table.expire()) == [("b", 2), ("c", 3)]
    assert sorted(table.take_dropped()) == [("b", 2), ("c", 3)] and table.take_dropped() == []


def test_without_keep_dropped_nothing_is_collected() -> None:
    table: TTLMap[str, int] = TTLMap(1, 10.0)
    table["a"], table["b"] = 1, 2
    assert table.take_dropped() == [] and list(table) == ["b"]


def test_the_ledger_refuses_a_duplicate_until_it_expires() -> None:
    clock = Clock()
    ledger = Ledger(2, 5.0, clock)
    assert ledger.add("x") and not ledger.add("x") and "x" in ledger
    clock.now += 5.0
    assert "x" not in ledger and ledger.add("x")
    ledger.discard("x")
    assert "x" not in ledger and len(ledger) == 0


def test_the_ledger_is_bounded() -> None:
    ledger = Ledger(2, 60.0, Clock())
    for key in "abc":
        ledger.add(key)
    assert len(ledger) == 2 and "a" not in ledger and "c" in ledger


def test_in_flight_parameters_may_be_read_while_at_d_and_for_the_ttl_after_admission() -> None:
    clock = Clock()
    inflight = InFlight(4, 30.0, clock)
    inflight.forwarded("k")
    inflight.forwarded("k")
    inflight.finished("k", admitted=False)
    assert inflight.may_be_read("k")  # the second request is still at D
    inflight.finished("k", admitted=True)
    clock.now += 29.0
    assert inflight.may_be_read("k")
    inflight.admitted("k")  # D admitted it again: the window starts over
    clock.now += 29.0
    assert inflight.may_be_read("k")
    clock.now += 1.0
    assert not inflight.may_be_read("k")
    inflight.finished("never-forwarded", admitted=False)
    assert not inflight.may_be_read("never-forwarded")


def test_an_expired_handshake_is_handed_back_before_the_same_engine_is_added_again() -> None:
    """NIXL names an agent by the remote: the old set's agents must be removed before a new
    handshake adds the same P workers, so ``take`` returns an expired set too."""
    clock = Clock()
    cache = HandshakeCache(4, 60.0, clock)
    first, other = peers("p1"), peers("p2")
    assert cache.put(first) == [] and cache.put(other) == []
    clock.now += 60.0
    assert cache.get("p1") is None  # expired: not served...
    assert cache.pop("p1", first) is None  # ...and not invalidated either
    assert sorted(p.engine_id for p in cache.take("p1")) == ["p1", "p2"]  # ...but handed back
    second = peers("p1")
    assert cache.put(second) == [] and cache.get("p1") is second and len(cache) == 1


def test_the_handshake_cache_returns_what_it_displaces() -> None:
    clock = Clock()
    cache = HandshakeCache(2, 60.0, clock)
    a, b, c = peers("a"), peers("b"), peers("c")
    cache.put(a), cache.put(b)
    assert cache.get("a") is a  # "a" used: "b" is now the least recent
    assert cache.put(c) == [b]
    a2 = peers("a")
    assert cache.put(a2) == [a]  # same engine, new set
    assert cache.pop("a", a) is None and cache.pop("a", a2) is a2
    assert cache.take("zzz") == []
    clock.now += 30.0
    d = peers("d")
    cache.put(d)
    clock.now += 30.0  # "c" expires, "d" does not
    assert cache.expire() == [c]
    assert cache.drain() == [d] and len(cache) == 0
