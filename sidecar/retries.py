"""Answers a proxy in front of the decode pods may retry on another pod, and what follows for a release.

A gateway or mesh in front of several decode pods may resend a failed request,
byte for byte, to another pod: Istio's default retry policy retries 503,
Envoy's ``gateway-error`` retries 502, 503 and 504 (``5xx``: every 5xx),
nginx with ``proxy_next_upstream http_503 non_idempotent``, haproxy with
``retry-on 503``. In sidecar mode the request carries P's
``kv_transfer_params``, so the retry makes the other pod's D read P's blocks:
if this sidecar released them, P may have reused them already and that D
decodes from another request's cache (silently wrong output).

``retried_statuses`` names the statuses such a proxy may retry. The judge
never releases behind an answer with one of them (the retry, or P's lease,
frees the blocks), and the sidecar's own answer to a request whose
parameters are already released (``replay_status``) is a status outside
them. Router mode is unaffected: the client's parameters are dropped there,
so a retry runs a fresh prefill.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

NONE = "none"
CLASSES = {"4xx": range(400, 500), "5xx": range(500, 600)}
#: The answer to a request whose parameters were released already, by preference. 409 is what
#: Envoy's ``retriable-4xx`` retries; an operator who retries it gets 410, then 400.
REPLAY_CHOICES = (409, 410, 400)


def problem(entries: Iterable[str]) -> str | None:
    """Why ``entries`` cannot be a ``retried_statuses`` value, or None."""
    entries = [entry.lower() for entry in entries]
    if NONE in entries and len(entries) > 1:
        return f"{NONE!r} stands alone (nothing in front of the decode pods retries)"
    for entry in entries:
        if entry == NONE or entry in CLASSES:
            continue
        if not entry.isdigit() or not 400 <= int(entry) <= 599:
            return f"{entry!r} is not a 4xx or 5xx status, 4xx, 5xx or {NONE!r}"
    if set(REPLAY_CHOICES) <= parse(entries):
        return "retrying 409, 410 and 400 leaves no status to refuse a spent request with"
    return None


def parse(entries: Iterable[str]) -> frozenset[int]:
    """The statuses ``entries`` name (``none``: no status)."""
    statuses: set[int] = set()
    for entry in (entry.lower() for entry in entries):
        if entry in CLASSES:
            statuses.update(CLASSES[entry])
        elif entry.isdigit():
            statuses.add(int(entry))
    return frozenset(statuses)


def replay_status(retried: frozenset[int]) -> int:
    """The status refusing a request whose parameters were released: one no proxy retries."""
    return next(status for status in REPLAY_CHOICES if status not in retried)


def shown(retried: frozenset[int]) -> str:
    """``retried`` for a log line or a check: ranges folded (``500-599``), ``none`` when empty."""
    if not retried:
        return NONE
    ordered, parts = sorted(retried), []
    start = previous = ordered[0]
    for status in [*ordered[1:], None]:
        if status is not None and status == previous + 1:
            previous = status
            continue
        parts.append(str(start) if start == previous else f"{start}-{previous}")
        if status is not None:
            start = previous = status
    return ",".join(parts)


def advice(retried: frozenset[int], injected: Iterable[int] = (), source: str = "") -> tuple[str, str]:
    """What an operator must know of ``retried`` (for the start-up log and ``check``): what is
    released, and what to configure in the gateway or mesh in front of the decode pods."""
    setting = f"retried_statuses {shown(retried)}" + (f" ({source})" if source else "")
    if not retried:
        return (
            f"{setting}: every rejection is released, D unreachable (503) included",
            "make sure no gateway or mesh in front of the decode pods retries this pod's answers on "
            "another pod (Istio retries 503 by default); or list what it retries "
            "(deploy/mesh has Istio and Envoy retry policies)",
        )
    what = (
        f"{setting}: rejections answered with them are not released, since a gateway or mesh in "
        "front of the decode pods may retry them on another pod, whose D reads P's blocks (P's "
        "lease frees them otherwise)"
    )
    skipped = sorted(set(injected) & retried)
    if skipped:
        what += f"; injected {','.join(map(str, skipped))} rejections are not released either"
    return (
        what,
        "retry no other status on the decode route (deploy/mesh); if nothing in front retries, set "
        "retried_statuses to none so that D unreachable, draining and over-limit answers (503) "
        "are released too",
    )


def announce(log: logging.Logger, entries: Iterable[str], injected: Iterable[int]) -> None:
    """The start-up line: ``advice``, a warning when nothing is retried (every 503 is released)."""
    retried = parse(entries)
    what, fix = advice(retried, injected)
    level = logging.INFO if retried else logging.WARNING
    log.log(level, "%s; %s", what, fix, extra={"setting": "retried_statuses"})
