"""What a release saved P: its blocks, and the pinned block-seconds it spared.

Without a release P keeps a rejected request's blocks until its own deadline:
the lease (``kv_lease_duration``, 30 s by default) from vLLM 0.22.0,
``VLLM_NIXL_ABORT_REQUEST_TIMEOUT`` (480 s by default) from 0.11.1 to 0.21.x,
120 s in 0.10.0-0.11.0, and no deadline at all before (counted as 480 s so
the estimate stays finite): ``DEADLINES``. ``p_hold_seconds`` overrides the table for a P
configured otherwise.
"""

from __future__ import annotations

from typing import NamedTuple

from sidecar.nixl.versions import parse_version

Version = tuple[int, int, int]


class Deadline(NamedTuple):
    """How long P holds an unreleased request's blocks, for the vLLM releases from ``since``."""

    since: Version
    seconds: float | None  # None: P never frees them by itself


#: P's deadline release by release, oldest first (vLLM's NIXL connector: no deadline before
#: 0.10.0; ``VLLM_NIXL_ABORT_REQUEST_TIMEOUT``, 120 s then 480 s by default; ``kv_lease_duration``).
DEADLINES: tuple[Deadline, ...] = (
    Deadline((0, 9, 0), None),
    Deadline((0, 10, 0), 120.0),
    Deadline((0, 11, 1), 480.0),
    Deadline((0, 22, 0), 30.0),
)
LEASE_SECONDS = 30.0
ABORT_TIMEOUT_SECONDS = 480.0  # the estimate's hold where P has no deadline at all (before 0.10.0)


def deadline_of(version: Version) -> float | None:
    """P's deadline for release ``version`` (None: none at all)."""
    found = DEADLINES[0].seconds
    for deadline in DEADLINES:
        if version >= deadline.since:
            found = deadline.seconds
    return found


def hold_seconds(version_text: str | None, configured: float = 0.0) -> float:
    """How long P holds an unreleased request's blocks: ``configured`` when set (> 0), else by
    P's release; an unknown release counts as the shortest hold (the lease), a release with no
    deadline as ``ABORT_TIMEOUT_SECONDS`` (the estimate stays finite)."""
    if configured > 0:
        return configured
    parsed = parse_version(version_text) if version_text else None
    if parsed is None:
        return LEASE_SECONDS
    seconds = deadline_of(parsed.release)
    return ABORT_TIMEOUT_SECONDS if seconds is None else seconds


#: The part of P's lease a router-mode release must leave: it is counted from when P's answer
#: arrived, a little after P stamped the lease, and the release still has to travel. A release
#: that arrives after the lease only makes P log an error (and kills a 0.10.0 engine); one
#: skipped within the margin leaves the blocks pinned for at most the margin.
LEASE_MARGIN_SHARE = 0.1
LEASE_MARGIN_MAX = 5.0


def lease_seconds(version_text: str | None, configured: float = 0.0) -> float | None:
    """How long after its answer P frees an unreleased request by itself, or None when it never
    does (0.9.x); ``configured`` (> 0) wins. An unknown release counts as the shortest lease."""
    parsed = parse_version(version_text) if version_text and configured <= 0 else None
    if parsed is not None and deadline_of(parsed.release) is None:
        return None
    return hold_seconds(version_text, configured)


def release_by(answered: float, lease: float) -> float:
    """The ``time.monotonic()`` after which a release would reach P past its lease (margin kept)."""
    return answered + lease - min(LEASE_MARGIN_MAX, lease * LEASE_MARGIN_SHARE)


def block_seconds_saved(blocks: int, hold: float, took: float) -> float:
    """``blocks`` x (P's hold - the time the release took), never negative."""
    return blocks * max(0.0, hold - took)
