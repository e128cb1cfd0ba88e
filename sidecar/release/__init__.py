"""Release pipeline: the ``Releaser`` protocol, the queue that feeds it, one module per strategy.

``make_releaser`` picks the strategy named by ``config.release`` (``stub``: off
and dry-run; ``nixl``, ``http``, ``auto``), wrapped by ``dryrun.DryRun`` with
``dry_run``; strategy modules are imported only when chosen, so ``off``,
``dry-run`` and ``http`` never load ZMQ or NIXL (``auto`` loads both ``http``
and ``nixl``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from prometheus_client import CollectorRegistry

from sidecar.config import Config
from sidecar.network.allowlist import Allowlist
from sidecar.observability.tracing import OFF, Tracing
from sidecar.release.base import LiveReleaser, Releaser

DecodeVersion = Callable[[], Awaitable[str | None]]


def make_releaser(
    config: Config,
    decode_version: DecodeVersion,
    registry: CollectorRegistry,
    tracing: Tracing = OFF,
    allowlist: Allowlist | None = None,
) -> Releaser:
    """The strategy named by ``config.release`` (rehearsing, with ``dry_run``); ``tracing``
    reaches the NIXL handshakes and ``allowlist`` (built once by the app) the NIXL target checks."""
    if config.release in ("off", "dry-run"):
        from sidecar.release.stub import StubReleaser

        return StubReleaser(config.release)
    live = _live(config, decode_version, registry, tracing, allowlist)
    if config.dry_run:
        from sidecar.release.dryrun import DryRun

        return DryRun(live)
    return live


def _live(
    config: Config,
    decode_version: DecodeVersion,
    registry: CollectorRegistry,
    tracing: Tracing,
    allowlist: Allowlist | None,
) -> LiveReleaser:
    if config.release == "http":
        from sidecar.release.http import HttpReleaser

        return HttpReleaser(config, decode_version, registry)
    if config.release in ("nixl", "auto"):
        from sidecar.nixl.handshake import TargetCheck
        from sidecar.release.nixl import NixlReleaser

        check = TargetCheck(allowlist if allowlist is not None else Allowlist(config.prefill_allow))
        nixl = NixlReleaser(config, decode_version, registry, tracing=tracing, check=check)
        if config.release == "nixl":
            return nixl
        from sidecar.release.auto import AutoReleaser

        return AutoReleaser(config, decode_version, registry, nixl=nixl)
    raise NotImplementedError(f"release strategy {config.release!r} is not available in this build")
