"""Prometheus collectors of the sidecar, on a registry injected at construction.

Names are prefixed ``kvr_``; label values are small enumerations (route,
status class, cause, strategy, result), never request ids or hosts. Label
children on the request path are resolved once and cached.
"""

from __future__ import annotations

from typing import Generic, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics import MetricWrapperBase

_M = TypeVar("_M", bound=MetricWrapperBase)

ROUTES = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completions",
    "/v1/responses": "responses",
    "/v1/messages": "messages",
    "/inference/v1/generate": "generate",
}
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class Children(Generic[_M]):
    """``metric.labels(*values)``, resolved once per set of values (small enumerations only):
    prometheus_client checks and converts the values on every ``labels`` call."""

    __slots__ = ("_found", "_metric")

    def __init__(self, metric: _M) -> None:
        self._metric = metric
        self._found: dict[tuple[str, ...], _M] = {}

    def __call__(self, *values: str) -> _M:
        found = self._found.get(values)
        if found is None:
            found = self._found[values] = self._metric.labels(*values)
        return found


class Metrics:
    """Every collector the proxy and the release pipeline update."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "kvr_requests", "Requests proxied to D.", ["route", "status_class"], registry=r
        )
        self.upstream_latency = Histogram(
            "kvr_upstream_latency_seconds",
            "Time from forwarding to D's response headers.",
            ["route"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.rejections = Counter(
            "kvr_rejections", "do_remote_prefill requests rejected before admission.", ["cause"], registry=r
        )
        self.not_released = Counter(
            "kvr_not_released",
            "do_remote_prefill requests whose outcome does not release: admitted, ambiguous, or "
            "retryable (a rejection whose status a proxy in front may retry on another decode pod).",
            ["outcome", "cause"],
            registry=r,
        )
        self.ineligible = Counter(
            "kvr_ineligible",
            "Inspected requests whose kv_transfer_params cannot be released.",
            ["reason"],
            registry=r,
        )
        self.replays = Counter(
            "kvr_released_replays",
            "Requests naming kv_transfer_params already released: refused (409), or forwarded "
            "when the strategy frees nothing.",
            ["action"],
            registry=r,
        )
        self.releases = Counter(
            "kvr_releases",
            "Release jobs finished, by strategy and result.",
            ["strategy", "result"],
            registry=r,
        )
        self.release_attempts = Counter(
            "kvr_release_attempts",
            "Release attempts, by strategy and reason: ok, the failure's reason, or target_down "
            "(the job found its target's breaker open and waited instead of connecting).",
            ["strategy", "reason"],
            registry=r,
        )
        self.release_targets = Gauge(
            "kvr_release_targets",
            "Release targets (P side channels, D's control endpoint) by breaker state.",
            ["state"],
            registry=r,
        )
        self.release_latency = Histogram(
            "kvr_release_latency_seconds",
            "From D's answer reaching the sidecar to the release being done.",
            ["strategy"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.released_blocks = Counter(
            "kvr_released_blocks",
            "P's KV blocks named by released requests (every block id of every KV-cache group), "
            "counted once per request when its release is sent.",
            ["strategy"],
            registry=r,
        )
        self.block_seconds_saved = Counter(
            "kvr_pinned_block_seconds_saved",
            "Estimated pinned block-seconds the releases spared P: blocks x (P's hold without a "
            "release - the time the release took).",
            ["strategy"],
            registry=r,
        )
        self.injected = Counter(
            "kvr_injected",
            "Rejections injected by the sidecar (load tests); never forwarded to D.",
            ["status_class"],
            registry=r,
        )
        self.leg_latency = Histogram(
            "kvr_leg_latency_seconds",
            "Router mode: latency of each leg to its response headers.",
            ["leg"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.leg_failures = Counter(
            "kvr_leg_failures", "Router mode: failed legs, by leg and cause.", ["leg", "cause"], registry=r
        )
        self.prefill_refused = Counter(
            "kvr_prefill_refused",
            "Router mode: x-prefiller-host-port targets refused (403), by reason: not_allowed (outside "
            "the allowlist) or an address no P can have (loopback, link_local, metadata, ...).",
            ["reason"],
            registry=r,
        )
        self.releases_enabled = Gauge(
            "kvr_releases_enabled",
            "1 while a release strategy runs; 0 when releases are off, and why: setting (release = off), "
            "kv_connector, ec_connector or moriio (a P/D protocol this sidecar does not release for).",
            ["reason"],
            registry=r,
        )
        self.unknown_vllm = Gauge(
            "kvr_vllm_unknown_version_info",
            "1 for a vLLM version P and D run that is newer than every release this sidecar knows "
            "(released as the newest known one unless unknown_vllm is refuse).",
            ["version"],
            registry=r,
        )
        self.version_unusable = Gauge(
            "kvr_vllm_version_unusable",
            "1 while D's GET /version answers something that is not a vLLM version, by reason: status "
            "(not 200), not_json, no_version (no version string) or not_a_version.",
            ["reason"],
            registry=r,
        )
        self.queue_depth = Gauge("kvr_release_queue_depth", "Release jobs waiting.", registry=r)
        self.ledger_size = Gauge(
            "kvr_release_ledger_size", "Entries in the de-duplication ledger.", registry=r
        )
        self.inflight = Gauge("kvr_inflight_requests", "Requests being proxied.", registry=r)
        # The proxy counts them in a plain int (two gauge updates per request cost more than the
        # request's own counting); the gauge reads it when scraped.
        self.requests_in_flight = 0
        self.inflight.set_function(lambda: self.requests_in_flight)
        self.ready = Gauge("kvr_ready", "1 when /readyz answers 200.", registry=r)
        self.decode_can_notify = Gauge(
            "kvr_decode_can_notify",
            "1 when D's engine can release its own handler rejections (alive, not shutting down, "
            "a KV connector); 0: the sidecar releases them too. Set while releases are sent.",
            registry=r,
        )
        # The children the request path updates (route, status class; route; outcome, cause;
        # cause; leg), resolved once.
        self.request_counter = Children(self.requests)
        self.latency_for = Children(self.upstream_latency)
        self.leg_latency_for = Children(self.leg_latency)
        self.not_released_for = Children(self.not_released)
        self.rejections_for = Children(self.rejections)

    def answered(self, route: str, status: int) -> None:
        """``kvr_requests_total`` for one answer on an inspected ``route`` (``status`` < 0: the
        client left before one)."""
        self.request_counter(ROUTES[route], status_class(status) if status >= 0 else "client_gone").inc()


def releases_enabled(metrics: Metrics, release: str, off_for: str) -> None:
    """``kvr_releases_enabled``: 1 with reason ``on``, or 0 with why releases are off."""
    on = release != "off"
    metrics.releases_enabled.labels("on" if on else off_for or "setting").set(1 if on else 0)


_STATUS_CLASSES = {status: f"{status // 100}xx" for status in range(100, 600)}  # made once, read per request


def status_class(status: int) -> str:
    return _STATUS_CLASSES.get(status, "error")
