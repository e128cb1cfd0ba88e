"""Which P process a release is for: P's agent names as its identity, outages as restart points."""

from __future__ import annotations

from sidecar.nixl.lineage import RESTART_GRACE, Lineage

P = ("10.0.0.7", 5600)
OLD, NEW = ("agent-a0", "agent-a1"), ("agent-b0", "agent-b1")


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def lineage() -> tuple[Lineage, Clock]:
    clock = Clock()
    return Lineage(64, 3600, clock), clock


def test_a_release_for_the_process_it_was_made_under_goes() -> None:
    known, clock = lineage()
    known.seen(P, OLD)
    clock.now += 5
    assert known.refusal(P, OLD, created=clock.now - 1) is None


def test_a_request_rejected_as_p_went_away_is_refused_by_the_process_that_came_back() -> None:
    known, clock = lineage()
    known.seen(P, OLD)
    clock.now += 5
    rejected = clock.now
    clock.now += 0.01
    known.lost(P)  # the release's own attempt finds P gone
    clock.now += 0.3
    known.lost(P)  # the first failure counts, not the later ones
    clock.now += 30
    known.seen(P, NEW)
    why = known.refusal(P, NEW, created=rejected)
    assert why is not None and "new process" in why and "before" in why
    assert known.refusal(P, NEW, created=rejected + 0.01 + RESTART_GRACE * 0.9) is not None


def test_a_request_rejected_well_after_p_was_found_gone_is_the_new_processes() -> None:
    known, clock = lineage()
    known.seen(P, OLD)
    known.lost(P)
    lost = clock.now
    clock.now += 20
    known.seen(P, NEW)
    assert known.refusal(P, NEW, created=lost + RESTART_GRACE + 0.1) is None
    assert known.refusal(P, NEW, created=clock.now + 1) is None  # made after it was seen


def test_the_same_process_after_an_outage_is_still_the_same() -> None:
    known, clock = lineage()
    known.seen(P, OLD)
    clock.now += 1
    known.lost(P)
    clock.now += 10
    known.seen(P, OLD)  # a network blip: the same agents answer again
    assert known.refusal(P, OLD, created=clock.now - 10.5) is None


def test_at_first_contact_after_an_outage_nothing_tells_a_restart_from_a_blip() -> None:
    known, clock = lineage()
    known.lost(P)
    clock.now += 10
    known.seen(P, NEW)
    assert known.refusal(P, NEW, created=clock.now - 10) is None


def test_a_restart_nobody_saw_go_down_is_taken_as_the_same_lineage() -> None:
    known, clock = lineage()
    known.seen(P, OLD)
    clock.now += 10
    known.seen(P, NEW)  # a send to the old agents failed, the handshake found new ones
    assert known.refusal(P, NEW, created=clock.now - 5) is None


def test_endpoints_are_apart() -> None:
    known, clock = lineage()
    other = ("10.0.0.8", 5600)
    known.seen(P, OLD)
    known.lost(P)
    clock.now += 5
    known.seen(P, NEW)
    known.seen(other, NEW)
    assert known.refusal(other, NEW, created=clock.now - 5) is None
    assert known.refusal(P, NEW, created=clock.now - 5) is not None


def test_a_blip_then_a_real_restart_refuses_what_was_rejected_during_the_real_outage() -> None:
    """The blip's outage ends when the same agents answer again: a later outage starts anew."""
    known, clock = lineage()
    known.seen(P, OLD)
    clock.now += 5
    known.lost(P)  # a blip: P unreachable for a while ...
    clock.now += 5
    known.seen(P, OLD)  # ... then the same process answers again
    clock.now += 90
    rejected = clock.now
    clock.now += 0.01
    known.lost(P)  # the real outage: the release for ``rejected`` finds P gone
    clock.now += 30
    known.seen(P, NEW)  # P restarted: new agents
    why = known.refusal(P, NEW, created=rejected)
    assert why is not None and "new process" in why
    assert known.refusal(P, NEW, created=rejected + 0.01 + RESTART_GRACE + 0.1) is None


def test_the_refusal_names_the_gap_the_endpoint_and_the_cause() -> None:
    known, clock = lineage()
    known.seen(P, OLD)
    rejected = clock.now
    clock.now += 0.25
    known.lost(P)
    clock.now += 30
    known.seen(P, NEW)
    assert known.refusal(P, NEW, created=rejected) == (
        "the request was rejected 0.250 s before P at 10.0.0.7:5600 was found unreachable, "
        "and P came back as a new process (new NIXL agents): its blocks went with the old one"
    )
    why = known.refusal(P, NEW, created=rejected + 0.5)  # rejected after P was found gone
    assert why is not None and why.startswith("the request was rejected 0.250 s after P at")
    why = known.refusal(P, NEW, created=rejected + 0.25)  # at the very moment
    assert why is not None and "0.000 s before" in why


def test_the_boundaries_belong_to_the_new_process() -> None:
    known, clock = lineage()
    known.seen(P, OLD)
    known.lost(P)
    lost = clock.now
    clock.now += 5
    known.seen(P, NEW)
    assert known.refusal(P, NEW, created=lost + RESTART_GRACE) is None  # the grace has run out
    assert known.refusal(P, NEW, created=clock.now) is None  # made as the new process was seen
    assert known.refusal(P, NEW, created=lost + RESTART_GRACE - 0.001) is not None


def test_a_request_made_as_a_quickly_restarted_p_was_seen_is_the_new_processes() -> None:
    known, clock = lineage()
    known.seen(P, OLD)
    known.lost(P)
    clock.now += RESTART_GRACE / 2  # back within the grace
    known.seen(P, NEW)
    assert known.refusal(P, NEW, created=clock.now) is None
    assert known.refusal(P, NEW, created=clock.now - 0.001) is not None


def test_only_the_identity_last_seen_is_judged() -> None:
    known, clock = lineage()
    known.seen(P, OLD)
    known.lost(P)
    clock.now += 5
    known.seen(P, NEW)
    # A release to agents P no longer has is not this check's business (the send fails).
    assert known.refusal(P, OLD, created=clock.now - 5) is None
    assert known.refusal(("10.0.0.9", 5600), NEW, created=clock.now - 5) is None  # never seen


def test_what_it_knows_of_an_endpoint_expires_on_its_clock() -> None:
    clock = Clock()
    known = Lineage(64, 60, clock)
    known.seen(P, OLD)
    known.lost(P)
    clock.now += 5
    known.seen(P, NEW)
    assert known.refusal(P, NEW, created=clock.now - 5) is not None
    clock.now += 61
    assert known.refusal(P, NEW, created=clock.now - 66) is None  # forgotten after its ttl


def test_handshakes_for_more_ranks_of_one_process_keep_its_lineage() -> None:
    """Every handshake asks rank (0, 0): names shared with what was seen are the same process."""
    known, clock = lineage()
    known.seen(P, OLD[:1])  # a claim of rank (0, 0) only
    known.lost(P)
    clock.now += 5
    known.seen(P, OLD)  # then both ranks: the same process, not a restart
    assert known.refusal(P, OLD, created=clock.now - 5) is None
    assert known.refusal(P, OLD[:1], created=clock.now - 5) is None


def test_the_topology_ps_own_parameters_named_is_kept_for_its_process_and_engine() -> None:
    known, _ = lineage()
    assert known.topology(P, "e") is None
    known.seen(P, OLD)
    assert known.topology(P, "e") is None  # a handshake alone proves no topology
    known.vouched(P, OLD, "e", [(0, 0), (0, 1)])
    assert known.topology(P, "e") == {(0, 0), (0, 1)}
    assert known.topology(P, "other-engine") is None and known.topology(("10.0.0.8", 5600), "e") is None
    known.seen(P, OLD[:1])  # the same process again
    assert known.topology(P, "e") == {(0, 0), (0, 1)}
    known.seen(P, NEW)  # a new process: its topology is not known yet
    assert known.topology(P, "e") is None
    known.vouched(P, OLD, "e", [(0, 0)])  # agents of a process gone prove nothing of this one
    assert known.topology(P, "e") is None
    known.vouched(P, NEW, "e", [(0, 0), (0, 1), (0, 2), (0, 3)])
    assert known.topology(P, "e") == {(0, 0), (0, 1), (0, 2), (0, 3)}


def test_a_handshake_for_fewer_ranks_keeps_every_name_the_process_showed() -> None:
    """A rank (0, 0)-only handshake after one of every rank leaves the process's identity whole:
    P's own parameters naming every rank still vouch for it, and a release to every rank is still
    judged as that process's."""
    known, clock = lineage()
    known.seen(P, OLD)
    known.seen(P, OLD[:1])
    known.vouched(P, OLD, "e", [(0, 0), (0, 1)])
    assert known.topology(P, "e") == {(0, 0), (0, 1)}
    known.lost(P)
    clock.now += 5
    known.seen(P, NEW)  # a restart after the outage
    assert known.refusal(P, NEW, created=clock.now - 5) is not None
    known.seen(P, NEW[:1])
    assert known.refusal(P, NEW, created=clock.now - 5) is not None  # still the process after the outage
