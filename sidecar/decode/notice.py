"""Says so when P and D run a vLLM newer than every release this sidecar knows.

Such a release is released as the newest known one by default (``unknown_vllm
= "newest"``, ``sidecar.nixl.versions``) or refused (``"refuse"``). Either way
an operator must hear of it once, and see it on a dashboard: the first time a
version is seen (set as ``vllm_version`` at start, or read from D's ``GET
/version``) a warning is logged and ``kvr_vllm_unknown_version_info{version}``
is set to 1.
"""

from __future__ import annotations

import logging

from prometheus_client import Gauge

from sidecar.config.settings import UnknownVllm
from sidecar.nixl.versions import NEWEST, newer_than_known

log = logging.getLogger("sidecar.version")

KNOWN_NEWEST = ".".join(map(str, NEWEST))


def effect(policy: UnknownVllm) -> str:
    """What releases do for a newer vLLM under ``policy``, in a sentence."""
    if policy == "newest":
        return (
            f"releases use vLLM {KNOWN_NEWEST}'s wire and rules while P's handshake reply decodes "
            "under them (refused as unknown_wire when it does not)"
        )
    return "the nixl strategy refuses its releases (unknown_version; unknown_vllm is refuse)"


class VersionNotice:
    """Warns once per version newer than every known release, and sets the metric."""

    def __init__(self, policy: UnknownVllm, gauge: Gauge) -> None:
        self._policy = policy
        self._gauge = gauge
        self._seen: set[str] = set()

    def seen(self, text: str | None) -> None:
        """A vLLM version P and D run (set, or read from D)."""
        if not text or text in self._seen or not newer_than_known(text):
            return
        self._seen.add(text)
        self._gauge.labels(text).set(1)
        log.warning(
            "vLLM %s is newer than every release this sidecar knows (newest %s): %s; upgrade "
            "kv-release-sidecar to a release that knows it",
            text,
            KNOWN_NEWEST,
            effect(self._policy),
            extra={"vllm_version": text, "unknown_vllm": self._policy},
        )
