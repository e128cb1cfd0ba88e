"""Rejection injection, for load tests in real clusters (off by default).

When enabled, a share of releasable ``do_remote_prefill`` requests (``inject_rate``,
reproducible with ``inject_seed``, optionally only on ``inject_routes``) and,
with ``inject_header``, any request carrying ``x-kvr-inject-reject: <status>``
is answered by the sidecar with a vLLM-shaped error and **never forwarded to
D**; P's blocks are then released exactly as for a real rejection. Injected
outcomes carry the cause ``injected`` in metrics and ``injected: true`` in
logs, so dashboards never mistake them for D's behaviour.
"""

from __future__ import annotations

import random
from collections.abc import Mapping

from sidecar.config import INSPECTED_ROUTES, Config

HEADER = b"x-kvr-inject-reject"


class Injector:
    """Decides, per inspected request, whether to answer an injected rejection."""

    def __init__(self, config: Config) -> None:
        self._rate = config.inject_rate
        self._random = random.Random(config.inject_seed)
        self._statuses = config.inject_statuses
        self._routes = frozenset(config.inject_routes or INSPECTED_ROUTES)
        self._header = config.inject_header
        self.enabled = bool(self._rate) or self._header

    def status_for(self, route: str, headers: Mapping[bytes, bytes], releasable: bool) -> int | None:
        """The status to inject, or None to forward the request normally; ``headers`` maps the
        request's header names to their first value."""
        if self._header:
            value = headers.get(HEADER)
            if value is not None:
                return _status(value)
        if self._rate and releasable and route in self._routes and self._random.random() < self._rate:
            return self._random.choice(self._statuses)
        return None


def _status(value: bytes) -> int | None:
    text = value.strip()
    if text.isdigit() and 400 <= int(text) <= 599:
        return int(text)
    return None
