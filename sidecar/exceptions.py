"""The sidecar's exception tree, one root, drawn once here.

Every exception the sidecar's own code raises derives from ``SidecarError``;
each is raised where its failure happens and translated, at most once, at
the boundary that handles it::

    SidecarError
    +-- ConfigError (sidecar.config)           a setting that cannot be used: exit 2 before any socket
    |   +-- FileError                          the config file or a secret file cannot be read
    +-- ListenError (sidecar.server.serve)            a port cannot be bound: exit 1
    +-- UpstreamError (sidecar.upstream)       no response headers from D, or a body D broke off;
    |                                          carries a classify.Failure (the proxy judges it)
    +-- ProtocolError (sidecar.upstream.http1)          D's bytes are not HTTP/1.1 (becomes UpstreamError)
    +-- BodyError (sidecar.upstream.http1)              the request body to D failed (becomes UpstreamError)
    +-- ClientGone (sidecar.proxy.body)              the client left while its body was being read
    +-- RouterError (sidecar.router.pool)      the prefill leg cannot run; its status is the answer
    +-- ReleaseError (here)                    one release attempt failed; ``reason`` is a metric label
        +-- RetryableReleaseError              retried by the pipeline until the job's deadline
        |   +-- PeerUnreachable, HandshakeTimeout, BadReply, NixlError   (sidecar.nixl)
        |   +-- ResolveFailed                  (sidecar.network.resolver)
        |   +-- ControlUnreachable, ControlFailed                        (sidecar.release.http)
        +-- PermanentReleaseError              refused at once (allowlist, unsupported release, ...)
            +-- EngineMismatch                 (sidecar.nixl)
            +-- Unresolvable                   (sidecar.network.resolver)

``sidecar.nixl`` and ``sidecar.release.http`` list their reasons. Errors of
libraries (httpx, zmq, NIXL) never cross a module boundary untranslated.
"""

from __future__ import annotations

from enum import StrEnum


class SidecarError(Exception):
    """The root of every exception the sidecar raises itself."""


class Verdict(StrEnum):
    """What one attempt says about its target's health (``sidecar.release.targets``)."""

    UP = "up"  # it reached the target: a success, or an answer the target gave
    DOWN = "down"  # a connect-level failure: refused, unreachable, no reply in time
    UNTOUCHED = "untouched"  # decided before any connection (allowlist, version, parameters)


class ReleaseError(SidecarError):
    """Base of every error a strategy raises for one job."""

    reason: str = "error"  # a small enum, usable as a metric label
    verdict: Verdict = Verdict.UP  # what the failure says about the target


class RetryableReleaseError(ReleaseError):
    """Worth trying again before the deadline: P unreachable, timeout, NIXL error."""

    reason = "retryable"


class PermanentReleaseError(ReleaseError):
    """Retrying cannot help: target not allowed, unknown vLLM release, bad parameters."""

    reason = "permanent"
    verdict = Verdict.UNTOUCHED  # most are decided before connecting; those after say UP

    def __init__(self, message: str, reason: str = "permanent") -> None:
        super().__init__(message)
        self.reason = reason
