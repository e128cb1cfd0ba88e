"""An InferencePool's members as allowlist entries (pure), and the allowlists they replace.

``Members`` is what the watch knows: the pool's selector and target ports and
the pods it selects. ``entries`` turns it into allowlist entries. A pod counts
while it has an IP and is not finished (``Succeeded`` or ``Failed``: its IP may
already belong to another pod). Pod names are not entries: the endpoint picker
names P by IP, and a name would be resolved at connect time.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from sidecar.network.allowlist import Allowlist, parse_entry

log = logging.getLogger("sidecar.k8s")
FINISHED = frozenset({"Succeeded", "Failed"})


class PoolWatch(Protocol):
    """What the app holds of a running watch (``sidecar.k8s.watch.Watch``), or of the supervisor's
    in a worker (``sidecar.k8s.shared.Follower``)."""

    @property
    def synced(self) -> bool: ...

    async def first_list(self, wait: float) -> None: ...

    async def close(self) -> None: ...


async def first_list(listed: asyncio.Event, wait: float, synced: Callable[[], bool]) -> None:
    """Wait up to ``wait`` seconds for ``listed``: the pool, and the pods it selects, listed."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(listed.wait(), wait)
    if not synced():
        log.warning("InferencePool not listed yet: every prefiller is refused until it is")


@dataclass
class Members:
    """The pool's spec and its pods' addresses, as last seen."""

    exists: bool = False
    selector: dict[str, str] = field(default_factory=dict)
    ports: tuple[int, ...] = ()
    pods: dict[str, tuple[str, ...]] = field(default_factory=dict)  # pod name -> its IPs

    def apply_pool(self, pool: dict[str, Any] | None) -> bool:
        """Take the pool's spec (None: deleted); True when the pod selector changed.

        v1 (``inference.networking.k8s.io``): ``selector.matchLabels`` and ``targetPorts``;
        v1alpha2 (``inference.networking.x-k8s.io``): a flat ``selector`` and ``targetPortNumber``."""
        spec = (pool or {}).get("spec") or {}
        labels = spec.get("selector") or {}
        flat = {k: v for k, v in labels.items() if isinstance(v, str)}
        selector = dict(labels.get("matchLabels") or {}) if "matchLabels" in labels else flat
        numbers = [p for p in spec.get("targetPorts") or () if _port(p)]
        if "targetPortNumber" in spec and _port({"number": spec["targetPortNumber"]}):
            numbers.append({"number": spec["targetPortNumber"]})
        ports = tuple(int(p["number"]) for p in numbers)
        changed = selector != self.selector or (pool is None) == self.exists
        self.exists, self.selector, self.ports = pool is not None, selector, ports
        return changed

    def apply_pod(self, kind: str, pod: dict[str, Any]) -> None:
        name = (pod.get("metadata") or {}).get("name", "")
        status = pod.get("status") or {}
        ips = _ips(status)
        if kind == "DELETED" or not ips or status.get("phase") in FINISHED:
            self.pods.pop(name, None)
        else:
            self.pods[name] = ips

    def entries(self, ports: str) -> tuple[list[str], list[str]]:
        """(router mode's entries: each IP on each target port, the release entries: each IP on
        ``ports``, the side-channel range)."""
        addresses = sorted({ip for ips in self.pods.values() for ip in ips}) if self.exists else []
        shown = [f"[{a}]" if ":" in a else a for a in addresses]
        prefill = [f"{a}:{p}" for a in shown for p in self.ports]
        return prefill, [f"{a}:{ports}" for a in shown]


def _port(entry: Any) -> bool:
    return isinstance(entry, dict) and isinstance(entry.get("number"), int) and 0 < entry["number"] < 65536


def _ips(status: dict[str, Any]) -> tuple[str, ...]:
    found = [status.get("podIP")] + [i.get("ip") for i in status.get("podIPs") or () if isinstance(i, dict)]
    valid = []
    for ip in found:
        try:
            valid.append(str(ipaddress.ip_address(str(ip))))
        except (TypeError, ValueError):
            continue
    return tuple(dict.fromkeys(valid))


class LiveAllowlist(Allowlist):
    """An allowlist whose watched part is replaced as the pool changes (static entries stay)."""

    def __init__(self, static: tuple[str, ...] | list[str]) -> None:
        super().__init__(static)
        self._static = self.entries

    def replace(self, entries: list[str]) -> None:
        self.entries = self._static + tuple(parse_entry(e) for e in entries)
