"""How a P worker reads one NIXL notification, per vLLM release (pure functions).

``parse_notification`` turns the raw bytes into a ``Done`` (``<id>[:<n>]``), a
``Heartbeat`` (``HB:<id>,<id>``, 0.22.0+) or a ``Malformed`` (what raises in a
real P's worker poll: non-UTF-8 bytes, no colon). ``expected_notifications``
applies the release's counting rule to the ``n`` of a held request; it raises
exactly where vLLM raises (``int()``, the ``tp_ratio`` assertion), so the
caller counts those as malformed. Order matters and follows vLLM: decode,
split on the last colon, check the id is held, only then parse ``n``.
"""

from __future__ import annotations

from dataclasses import dataclass

from sidecar.sim.prefill.release import Release

HEARTBEAT_PREFIX = b"HB:"


@dataclass(frozen=True, slots=True)
class Done:
    """``<id>:<n>`` (``count`` is the raw text after the last colon; None on 0.9.0)."""

    request_id: str
    count: str | None


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """``HB:`` + comma-separated request ids: extend those leases (0.22.0+)."""

    request_ids: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Malformed:
    """A message that raises in vLLM's worker before any id is looked up."""

    reason: str


Notification = Done | Heartbeat | Malformed


def parse_notification(release: Release, raw: bytes) -> Notification:
    """Classify one raw notification the way ``release``'s worker poll does."""
    if release.heartbeats and raw.startswith(HEARTBEAT_PREFIX):
        try:
            body = raw[len(HEARTBEAT_PREFIX) :].decode("utf-8")
        except UnicodeDecodeError:
            return Malformed("heartbeat is not UTF-8")
        return Heartbeat(tuple(part for part in body.split(",") if part))
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return Malformed("not UTF-8")
    if release.count_rule == "first":
        return Done(text, None)  # 0.9.0: the whole message is the id
    request_id, colon, count = text.rpartition(":")
    if not colon:
        return Malformed("no colon")
    return Done(request_id, count)


def expected_notifications(release: Release, count: str | None, p_tp: int) -> int:
    """Notifications this rank waits for before freeing, from the message's ``n``.

    Raises ``ValueError`` (``n`` not an int), ``AssertionError`` (0.14.0-0.28.x:
    neither of ``n`` and P's TP size divides the other) or ``ZeroDivisionError``
    (``n`` = 0 there), as vLLM does.
    """
    if release.count_rule == "first" or count is None:
        return 1
    n = int(count)
    if release.count_rule == "equal":
        return n  # 0.9.1-0.13.x: tp_ratio; 0.29.0+: readers of this rank
    # 0.14.0-0.28.x: n is D's TP size; TpKVTopology.tp_ratio asserts divisibility.
    if p_tp % n != 0 and n % p_tp != 0:
        raise AssertionError(f"tp_ratio: neither {n} nor {p_tp} divides the other")
    return n // p_tp if n > p_tp else 1


def heartbeat_extension(lease: float) -> float:
    """Seconds a heartbeat extends a lease to: ``kv_lease_duration * 2 // 3``."""
    return lease * 2 // 3
