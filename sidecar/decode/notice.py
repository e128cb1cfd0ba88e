"""Says so when P and D run a vLLM newer than every release this sidecar knows, or when D's
``GET /version`` answers no version at all.

A newer release is released as the newest known one by default (``unknown_vllm
= "newest"``, ``sidecar.nixl.versions``) or refused (``"refuse"``). Either way
an operator must hear of it once, and see it on a dashboard: the first time a
version is seen (set as ``vllm_version`` at start, or read from D's ``GET
/version``) a warning is logged and ``kvr_vllm_unknown_version_info{version}``
is set to 1.

An answer that is no version (another status than 200, a body that is not JSON
or is empty, JSON without a version string, a string that is no version) leaves
P's release unknown unless ``vllm_version`` is set: the nixl strategy then
refuses every release. It is said the same way, from the first probe at start:
a warning when the answer turns unusable (or its reason changes), and
``kvr_vllm_version_unusable{reason}`` is 1 until D names a version again.
"""

from __future__ import annotations

import logging

from prometheus_client import Gauge

from sidecar.config.settings import UnknownVllm
from sidecar.decode.probes import VersionRead
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
    """Warns once per version newer than every known release, and when D's answer is no version;
    sets the metrics (see the module docstring)."""

    def __init__(
        self, policy: UnknownVllm, gauge: Gauge, unusable: Gauge | None = None, configured: str = ""
    ) -> None:
        self._policy = policy
        self._gauge = gauge
        self._unusable_gauge = unusable
        self._configured = configured  # vllm_version: then D's answer decides nothing
        self._seen: set[str] = set()
        self._unusable: str | None = None  # the reason D's last answer was no version

    def read(self, answer: VersionRead) -> None:
        """One answer of D's ``GET /version`` (nothing when D did not answer: that says nothing of
        its version, and D's state says it is unreachable)."""
        self.seen(answer.version)
        if not answer.answered or self._unusable_gauge is None:
            return
        if answer.reason is None:
            if self._unusable is not None:
                self._unusable_gauge.labels(self._unusable).set(0)
                log.info("D's GET /version names vLLM %s again", answer.version)
            self._unusable = None
            return
        if answer.reason == self._unusable:
            return
        if self._unusable is not None:
            self._unusable_gauge.labels(self._unusable).set(0)
        self._unusable = answer.reason
        self._unusable_gauge.labels(answer.reason).set(1)
        if self._configured:
            effect = f"releases use vllm_version {self._configured}; check that D is the vLLM it names"
        else:
            effect = (
                "P's vLLM release is unknown, so the nixl strategy refuses every release "
                "(unknown_version) until D names a version; set vllm_version to P's and D's release"
            )
        log.warning(
            "D's GET /version %s: %s",
            answer.problem,
            effect,
            extra={"reason": answer.reason, "vllm_version": self._configured},
        )

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
