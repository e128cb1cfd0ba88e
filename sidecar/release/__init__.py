"""Release pipeline: the ``Releaser`` protocol, the queue that feeds it, one module per strategy.

``make_releaser`` picks the strategy named by ``config.release``; strategy
modules are imported only when chosen, so ``off``, ``dry-run`` and ``http`` never
load ZMQ or NIXL (``auto`` loads both ``http`` and ``nixl``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from prometheus_client import CollectorRegistry

from sidecar.config import Config
from sidecar.release.base import Releaser
from sidecar.tracing import OFF, Tracing

DecodeVersion = Callable[[], Awaitable[str | None]]


def make_releaser(
    config: Config, decode_version: DecodeVersion, registry: CollectorRegistry, tracing: Tracing = OFF
) -> Releaser:
    """The strategy named by ``config.release``; ``tracing`` reaches the NIXL handshakes."""
    if config.release == "off":
        from sidecar.release.off import OffReleaser

        return OffReleaser()
    if config.release == "dry-run":
        from sidecar.release.dryrun import DryRunReleaser

        return DryRunReleaser()
    if config.release == "nixl":
        from sidecar.release.nixl import NixlReleaser

        return NixlReleaser(config, decode_version, registry, tracing=tracing)
    if config.release == "http":
        from sidecar.release.http import HttpReleaser

        return HttpReleaser(config, decode_version, registry)
    if config.release == "auto":
        from sidecar.release.auto import AutoReleaser

        if not tracing.enabled:
            return AutoReleaser(config, decode_version, registry)
        from sidecar.release.nixl import NixlReleaser

        nixl = NixlReleaser(config, decode_version, registry, tracing=tracing)
        return AutoReleaser(config, decode_version, registry, nixl=nixl)
    raise NotImplementedError(f"release strategy {config.release!r} is not available in this build")
