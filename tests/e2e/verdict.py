"""The verdict on one scenario: does P's evidence show what the scenario expects? Pure functions.

A scenario passes only on P's own evidence: the blocks it pinned were freed
before its lease ran out (no expiry counted, no "Releasing expired KV
blocks" line), by exactly one notification (no notification for an id P no
longer held, no "unrecognized request" line), and by the party the scenario
expects (the sidecar's release counts, D's NIXL reads). A scenario in which P
never held blocks tested nothing and fails too.

Every problem has a ``Kind``. Only two kinds are about time, ``EXPIRED`` (P's
lease freed the blocks: the expected notification never came in time) and
``LATE`` (the one expected notification reached P after its lease, or P
freed only after it). A third is the harness's own: ``UNSENT``, its request
failed without an answer and the sidecar counted no request meanwhile, so the
system under test never read it (the sidecar closes a new connection that
sends nothing for ``client_header_timeout``, 10 s, quietly, as uvicorn and
nginx do; a harness starved that long between its connect and its write
gets "Server disconnected without sending a response"). Nothing else is
judged of such an attempt. ``retry_allowed`` reruns a scenario only when every
problem is of those kinds and the machine measurably stalled inside the
scenario's release window; a wrong status (an answer missing after the
sidecar read the request included), a duplicate notification, an
unexpected release count, a read that should not be (or should be), or an
answer different from D's own is reported on the first attempt.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from enum import StrEnum

from tests.e2e.evidence import Evidence
from tests.e2e.scenarios import Expect
from tests.e2e.stalls import STALL

#: Attempts at a scenario at most (the first and up to two reruns after a timing failure in a stall).
ATTEMPTS = 3
#: The sidecar's ``kvr_releases_total`` results that are release attempts: each must be as expected.
ATTEMPTED = ("sent", "failed", "refused", "dropped")


class Kind(StrEnum):
    """What kind of fault a problem is; ``TIMING`` holds the kinds a stall can explain."""

    STATUS = "status"  # the client got another status
    UNPINNED = "unpinned"  # P held nothing (the scenario tested nothing), or pinned what it must not
    P_FAILURE = "p-failure"  # P counted a failed notification or transfer
    EXPIRED = "expired"  # P's lease freed the blocks
    LATE = "late"  # freed after the lease, or the one notification arrived after it
    DUPLICATE = "duplicate"  # a notification for a request P no longer held, not explained by lateness
    RELEASES = "releases"  # the sidecar's sent/failed/refused/dropped counts are not what they must be
    READ = "read"  # D read blocks it must not, or made no read
    OUTPUT = "output"  # the P/D answer differs from D's own (or could not be compared)
    NO_EXPIRY = "no-expiry"  # a scenario only P's lease can free was freed otherwise
    PREFILLS = "prefills"  # P ran another number of prefills than the front must have asked for
    UNSENT = "unsent"  # the harness's request never reached the sidecar (closed unread, uncounted)


TIMING = frozenset({Kind.EXPIRED, Kind.LATE, Kind.UNSENT})


@dataclass(frozen=True)
class Problem:
    """One reason a scenario failed."""

    kind: Kind
    text: str

    def __str__(self) -> str:
        return self.text


def retry_allowed(kinds: Collection[Kind], window_stall: float, attempts: int) -> bool:
    """Whether a failed attempt may be run again.

    Only when it failed (``kinds`` not empty), every fault is about time, the longest stall
    measured inside its release window (``tests.e2e.stalls``) is at least ``STALL`` seconds,
    and fewer than ``ATTEMPTS`` attempts were made.
    """
    return bool(kinds) and set(kinds) <= TIMING and window_stall >= STALL and attempts < ATTEMPTS


def kinds_of(problems: Collection[Problem]) -> list[Kind]:
    """The distinct kinds of ``problems``, in order."""
    return list(dict.fromkeys(problem.kind for problem in problems))


def judge(
    expect: Expect,
    status: int,
    ev: Evidence,
    also: frozenset[int] = frozenset(),
    prefills: int | None = None,
) -> list[Problem]:
    """Why the scenario failed; an empty list when it passed. ``also``: other statuses the client
    may get (``Scenario.also_accepted``). ``prefills``: how many prefills P must have run for the
    request (a front that retries the whole pair), each freed as ``expect`` says; None: one, its
    count not checked."""
    if ev.transport_error is not None and not ev.sidecar_requests:
        return [Problem(Kind.UNSENT, f"the request never reached the sidecar ({ev.transport_error})")]
    problems = _status(status, ev, also)
    if prefills is not None and ev.prefills != prefills:
        problems.append(Problem(Kind.PREFILLS, f"P ran {ev.prefills} prefills for it, not {prefills}"))
    count = prefills or 1
    if expect is Expect.NOT_PINNED:
        if ev.pinned:
            problems.append(Problem(Kind.UNPINNED, "P served a prefill leg for it"))
        return problems + _releases(ev, 0)
    if not ev.pinned:
        return [*problems, Problem(Kind.UNPINNED, "P held no block for it: the scenario tested nothing")]
    if ev.failed_notifications or ev.failed_transfers:
        problems.append(
            Problem(
                Kind.P_FAILURE,
                f"P counted failures: {ev.failed_notifications} notifications, "
                f"{ev.failed_transfers} transfers",
            )
        )
    if expect is Expect.LEASE:  # the sidecar tried (http: D's endpoint is down) and could not
        return problems + _expired(ev, count) + _releases(ev, 0, may_fail=True)
    if expect is Expect.LEFT:
        return problems + _expired(ev) + _releases(ev, 0) + _left(ev)
    problems += _freed_once(ev)
    if expect is Expect.SIDECAR_FREES:
        problems += _releases(ev, count) + _no_read(ev)
    elif expect is Expect.D_FREES:
        problems += _releases(ev, 0) + _no_read(ev)
    else:
        problems += _releases(ev, 0) + _read(ev)
    return problems


def _status(status: int, ev: Evidence, also: frozenset[int]) -> list[Problem]:
    if ev.transport_error is not None:
        return [
            Problem(Kind.STATUS, f"the sidecar read the request and gave no answer ({ev.transport_error})")
        ]
    if ev.status != status and ev.status not in also:
        return [Problem(Kind.STATUS, f"the client got {ev.status or 'no status'}, not {status}")]
    return []


def _freed_once(ev: Evidence) -> list[Problem]:
    problems = []
    expired = ev.expired or len(ev.p_log.expired)
    if expired:
        problems.append(
            Problem(Kind.EXPIRED, f"P's lease freed it: expired +{ev.expired}, log {list(ev.p_log.expired)}")
        )
    if ev.freed_after is None:
        problems.append(Problem(Kind.LATE, "P still held its blocks after its lease"))
    elif ev.freed_after >= ev.lease and ev.first_poll < ev.lease:
        # (A first look after the lease, when the answer took that long, cannot time the free: P's
        # expiry counter and log then say whether the lease or a notification freed the blocks.)
        problems.append(
            Problem(Kind.LATE, f"P freed it only after {ev.freed_after:.1f} s (lease {ev.lease:g} s)")
        )
    unrecognized = max(ev.after_expiry, len(ev.p_log.unrecognized))
    if unrecognized:
        # After an expiry, one notification for the request is the expected one, late; any more
        # (or one without an expiry) is a second notification for blocks P already freed.
        late = bool(expired) and unrecognized == 1
        problems.append(
            Problem(
                Kind.LATE if late else Kind.DUPLICATE,
                (
                    "the notification reached P after its lease"
                    if late
                    else "P got a notification for a request it no longer held (a duplicate)"
                )
                + f": +{ev.after_expiry}, log {list(ev.p_log.unrecognized)}",
            )
        )
    return problems


def _expired(ev: Evidence, count: int = 1) -> list[Problem]:
    """P's lease freed the request's blocks: ``count`` prefills' worth, by P's counter and log."""
    if ev.expired < count or len(ev.p_log.expired) < count:
        return [
            Problem(
                Kind.NO_EXPIRY,
                f"P's lease did not free it: expired +{ev.expired}, log {list(ev.p_log.expired)}",
            )
        ]
    return []


def _releases(ev: Evidence, sent: int, may_fail: bool = False) -> list[Problem]:
    """The sidecar made exactly ``sent`` release attempts, all delivered (``may_fail``: and at
    most one that failed at its deadline)."""
    attempted = {result: ev.sidecar.get(result, 0) for result in ATTEMPTED}
    if may_fail and attempted["failed"] <= 1:
        attempted["failed"] = 0
    if attempted != {**dict.fromkeys(ATTEMPTED, 0), "sent": sent}:
        return [
            Problem(Kind.RELEASES, f"the sidecar sent {ev.sidecar_sent} releases, not {sent} ({ev.sidecar})")
        ]
    return []


def _left(ev: Evidence) -> list[Problem]:
    """The sidecar (behind a front: each one that answered) left the 503 to a retry elsewhere."""
    if ev.not_released.get("retryable", 0) < 1:
        return [
            Problem(
                Kind.RELEASES, f"the sidecar did not leave it to a retry on another pod: {ev.not_released}"
            )
        ]
    return []


def _no_read(ev: Evidence) -> list[Problem]:
    return [Problem(Kind.READ, f"D read P's blocks ({ev.d_reads} NIXL reads)")] if ev.d_reads else []


def _read(ev: Evidence) -> list[Problem]:
    problems = []
    if ev.d_reads < 1:
        problems.append(Problem(Kind.READ, "D made no NIXL read"))
    if ev.same_output is None:
        problems.append(Problem(Kind.OUTPUT, "the answer was not compared with D's own"))
    elif not ev.same_output:
        found = "; ".join(ev.output_differences) or f"{ev.output!r} vs D's own {ev.reference!r}"
        problems.append(Problem(Kind.OUTPUT, f"the P/D answer differs from D's own: {found}"))
    return problems
