"""The verdict on one scenario: does P's evidence show what the scenario expects? A pure function.

A scenario passes only on P's own evidence: the blocks it pinned were freed
before its lease ran out (no expiry counted, no "Releasing expired KV
blocks" line), by exactly one notification (no notification for an id P no
longer held, no "unrecognized request" line), and by the party the scenario
expects (the sidecar's release count, D's NIXL reads). A scenario in which P
never held blocks tested nothing and fails too.
"""

from __future__ import annotations

from tests.e2e.evidence import Evidence, PLog
from tests.e2e.scenarios import Expect


def judge(expect: Expect, status: int, ev: Evidence) -> list[str]:
    """Why the scenario failed; an empty list when it passed."""
    problems = _status(status, ev)
    if expect is Expect.NOT_PINNED:
        if ev.pinned:
            problems.append("P served a prefill leg for it")
        return problems + _sent(ev, 0)
    if not ev.pinned:
        return [*problems, "P held no block for it: the scenario tested nothing"]
    if ev.failed_notifications or ev.failed_transfers:
        problems.append(
            f"P counted failures: {ev.failed_notifications} notifications, {ev.failed_transfers} transfers"
        )
    if expect is Expect.LEASE:
        return problems + _expired(ev) + _sent(ev, 0)
    problems += _freed_once(ev)
    if expect is Expect.SIDECAR_FREES:
        problems += _sent(ev, 1) + _no_read(ev)
    elif expect is Expect.D_FREES:
        problems += _sent(ev, 0) + _no_read(ev)
    else:
        problems += _sent(ev, 0) + _read(ev)
    return problems


def only_late(expect: Expect, status: int, ev: Evidence) -> bool:
    """Whether the only fault is time: the expected notification reached P, but after its lease.

    P then shows an expiry and one notification for a request it no longer held, with the
    party the scenario expects (the sidecar or D) having sent exactly what it should. On a
    loaded machine that is the machine's slowness; the run tries such a scenario once more.
    """
    if expect in (Expect.LEASE, Expect.NOT_PINNED) or not (ev.expired and ev.after_expiry == 1):
        return False
    on_time = Evidence(**{**vars(ev), "expired": 0, "after_expiry": 0, "freed_after": 0.0, "p_log": PLog()})
    return judge(expect, status, on_time) == []


def _status(status: int, ev: Evidence) -> list[str]:
    if ev.status != status:
        return [f"the client got {ev.status or 'no status'}, not {status}"]
    return []


def _freed_once(ev: Evidence) -> list[str]:
    problems = []
    if ev.expired or ev.p_log.expired:
        problems.append(f"P's lease freed it: expired +{ev.expired}, log {list(ev.p_log.expired)}")
    if ev.freed_after is None:
        problems.append("P still held its blocks")
    elif ev.freed_after >= ev.lease:
        problems.append(f"P freed it only after {ev.freed_after:.1f} s (lease {ev.lease:g} s)")
    if ev.after_expiry or ev.p_log.unrecognized:
        problems.append(
            f"P got a notification for a request it no longer held (a duplicate): +{ev.after_expiry}, "
            f"log {list(ev.p_log.unrecognized)}"
        )
    return problems


def _expired(ev: Evidence) -> list[str]:
    if ev.expired < 1 or not ev.p_log.expired:
        return [f"P's lease did not free it: expired +{ev.expired}, log {list(ev.p_log.expired)}"]
    return []


def _sent(ev: Evidence, count: int) -> list[str]:
    if ev.sidecar_sent != count:
        return [f"the sidecar sent {ev.sidecar_sent} releases, not {count} ({ev.sidecar})"]
    return []


def _no_read(ev: Evidence) -> list[str]:
    return [f"D read P's blocks ({ev.d_reads} NIXL reads)"] if ev.d_reads else []


def _read(ev: Evidence) -> list[str]:
    problems = []
    if ev.d_reads < 1:
        problems.append("D made no NIXL read")
    if ev.same_output is None:
        problems.append("the answer was not compared with D's own")
    elif not ev.same_output:
        problems.append(f"the P/D answer {ev.output!r} differs from D's own {ev.reference!r}")
    return problems
