"""The allowed P hosts: static (``prefill_allow``), or the pods an InferencePool selects, watched.

With ``inference_pool`` set (llm-d's ``--enable-ssrf-protection --inference-pool``)
the sidecar watches that InferencePool and the pods its selector matches from
the Kubernetes API (``watch``, in-cluster service-account auth), and keeps two
allowlists current (``members``): router mode's P, each pod's IP on the pool's
target ports, which ``x-prefiller-host-port`` is checked against (403
otherwise); and the release pipeline's, each pod's IP on P's side-channel
ports (``pool_side_channel_ports``). Both also hold ``prefill_allow``'s entries.
Without a pool, ``prefill_allow`` is the one static list; when it is empty too,
``prefill_allow_default = "routable"`` admits any address a P pod can have
(``sidecar.network.routable``), llm-d's own default made safer. With several
worker processes only the supervisor watches (``publishing_watch``), and each
worker follows the lists it writes (``sidecar.k8s.shared``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from sidecar.config import Config
from sidecar.k8s.members import LiveAllowlist, PoolWatch
from sidecar.network.allowlist import Allowlist
from sidecar.network.routable import RoutableAllowlist

# The serving port answers 503 for at most this long while the pool and its pods are first listed
# (the app's ``starting``); /readyz says when the lists came.
FIRST_SYNC_SECONDS = 10.0

__all__ = [
    "Allowlists", "LiveAllowlist", "PoolWatch", "publishing_watch", "static_allowlist", "watched_allowlists",
]  # fmt: skip


@dataclass(frozen=True, slots=True)
class Allowlists:
    prefill: Allowlist  # router mode: the hosts x-prefiller-host-port may name
    release: Allowlist  # the NIXL targets: P's side channels
    watch: PoolWatch | None = None


def watched_allowlists(config: Config, shared: Path | None = None) -> Allowlists:
    """Static lists (one object for both), or live ones kept by a started ``PoolWatch``, whose
    first lists are still to come (``PoolWatch.first_list``): this process's own watch, or with
    ``shared`` (a worker) the supervisor's, followed through that file."""
    if not config.inference_pool:
        static = static_allowlist(config)
        return Allowlists(static, static)
    prefill, release = LiveAllowlist(config.prefill_allow), LiveAllowlist(config.prefill_allow)
    if shared is not None:
        from sidecar.k8s.shared import Follower

        follower = Follower(shared, prefill, release)
        follower.launch()
        return Allowlists(prefill, release, follower)
    from sidecar.k8s.watch import start_pool_watch  # needs the llm-d extra (lightkube)

    return Allowlists(prefill, release, start_pool_watch(config, prefill, release))


def publishing_watch(config: Config, path: Path) -> PoolWatch:
    """The supervisor's watch, started: it writes each change of the lists to ``path`` for its
    workers (``sidecar.k8s.shared``), which add ``prefill_allow`` themselves."""
    from sidecar.k8s.shared import Publisher
    from sidecar.k8s.watch import start_pool_watch  # needs the llm-d extra (lightkube)

    return start_pool_watch(config, LiveAllowlist(()), LiveAllowlist(()), Publisher(path).publish)


def static_allowlist(config: Config) -> Allowlist:
    """``prefill_allow``; when it is empty, what ``prefill_allow_default`` admits."""
    if not config.prefill_allow and config.prefill_allow_default == "routable":
        return RoutableAllowlist()
    return Allowlist(config.prefill_allow)
