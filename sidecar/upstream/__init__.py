"""The only module that knows how the sidecar talks HTTP to D; the interface below is the seam."""

from __future__ import annotations

from sidecar.upstream.client import (
    Client,
    Response,
    Sent,
    Upstream,
    UpstreamError,
    UpstreamResponse,
)

__all__ = [
    "Client",
    "Response",
    "Sent",
    "Upstream",
    "UpstreamError",
    "UpstreamResponse",
]
