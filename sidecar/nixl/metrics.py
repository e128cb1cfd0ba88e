"""Prometheus collectors of the NIXL release strategy, on a registry passed in.

Every name starts with ``kvr_nixl_``; labels are small enumerations
(``outcome``, ``reason``, ``result``, ``path``), never hosts, engine ids or
request ids. Without a registry the collectors go to a private one, so
several strategies (tests) never collide on the global registry.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from sidecar.observability.metrics import Children

_LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class NixlMetrics:
    """The collectors; one instance per ``NixlReleaser``."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        reg = self.registry
        self.releases = Counter(
            "kvr_nixl_releases",
            "Release attempts by outcome (sent, would_send, refused, error).",
            ["outcome"],
            registry=reg,
        )
        self.refused = Counter(
            "kvr_nixl_refused",
            "Jobs skipped without sending anything, by reason (unknown_version, not_allowed, ...).",
            ["reason"],
            registry=reg,
        )
        self.errors = Counter(
            "kvr_nixl_errors",
            "Retryable failures by reason (unreachable, handshake_timeout, bad_reply, ...).",
            ["reason"],
            registry=reg,
        )
        self.handshakes = Counter(
            "kvr_nixl_handshakes",
            "Handshakes with a P engine by result (ok, error).",
            ["result"],
            registry=reg,
        )
        self.cache = Counter(
            "kvr_nixl_handshake_cache",
            "Handshake cache look-ups by result (hit, miss).",
            ["result"],
            registry=reg,
        )
        self.evictions = Counter(
            "kvr_nixl_handshake_cache_evictions",
            "Cached P engines dropped, by reason (lru, ttl, generation, replaced, send_failure, shutdown).",
            ["reason"],
            registry=reg,
        )
        self.engines = Gauge(
            "kvr_nixl_handshake_cache_engines", "P engines in the handshake cache.", registry=reg
        )
        self.notifications = Counter(
            "kvr_nixl_notifications", "NIXL notifications by result (ok, error).", ["result"], registry=reg
        )
        self.loopback = Counter(
            "kvr_nixl_loopback_targets",
            "Handshakes aimed at a loopback remote_host that no allowlist entry names itself (P may have "
            "left VLLM_NIXL_SIDE_CHANNEL_HOST unset).",
            registry=reg,
        )
        self.handshake_seconds = Histogram(
            "kvr_nixl_handshake_seconds",
            "Time to handshake every worker of one P engine and add its agents.",
            buckets=_LATENCY_BUCKETS,
            registry=reg,
        )
        self.release_seconds = Histogram(
            "kvr_nixl_release_seconds",
            "Time from release() to every notification sent, by path (warm: cached handshake; cold).",
            ["path"],
            buckets=_LATENCY_BUCKETS,
            registry=reg,
        )
        # The children every release updates, resolved once.
        self.outcome = Children(self.releases)
        self.lookup = Children(self.cache)
        self.notified = Children(self.notifications)
        self.seconds = Children(self.release_seconds)
