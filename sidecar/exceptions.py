"""The sidecar's exception tree, one root, drawn once here.

Every exception the sidecar's own code raises derives from ``SidecarError``;
each is raised where its failure happens and translated, at most once, at
the boundary that handles it::

    SidecarError
    +-- ConfigError (sidecar.config)           a setting that cannot be used: exit 2 before any socket
    |   +-- FileError                          the config file or a secret file cannot be read
    +-- ListenError (sidecar.server.serve)            a port cannot be bound: exit 1
    +-- UpstreamError (sidecar.upstream)       no response headers from D, or a body D broke off;
    |                                          carries a classify.NoAnswer (the proxy judges it)
    +-- ProtocolError (sidecar.upstream.http1)          D's bytes are not HTTP/1.1 (becomes UpstreamError)
    +-- BodyError (sidecar.upstream.http1)              the request body to D failed (becomes UpstreamError)
    +-- ClientGone (sidecar.proxy.context)           the client left while its body was being read
    +-- RouterError (sidecar.router.pool)      the prefill leg cannot run; its status is the answer
    +-- ReleaseError (here)                    one release attempt failed; ``reason`` is a metric label
        +-- RetryableReleaseError              retried by the pipeline until the job's deadline
        |   +-- PeerUnreachable, HandshakeTimeout, BadReply, NixlError   (sidecar.nixl)
        |   +-- ResolveFailed                  (sidecar.network.resolver)
        |   +-- ControlUnreachable, ControlFailed                        (sidecar.release.http)
        +-- PermanentReleaseError              refused at once (allowlist, unsupported release, ...)
            +-- EngineMismatch, TopologyMismatch   (sidecar.nixl)
            +-- Unresolvable                   (sidecar.network.resolver)

``sidecar.nixl`` and ``sidecar.release.http`` list their reasons. Errors of
libraries (httpx, zmq, NIXL) never cross a module boundary untranslated.
"""

from __future__ import annotations

from enum import StrEnum


class SidecarError(Exception):
    """The root of every exception the sidecar raises itself."""


class TargetHealth(StrEnum):
    """What one attempt says about its target's health, for its breaker (``sidecar.release.pipeline``)."""

    UP = "up"  # it reached the target: a success, or an answer the target gave
    DOWN = "down"  # a connect-level failure: refused, unreachable, no reply in time
    UNTOUCHED = "untouched"  # decided before any connection (allowlist, version, parameters)


class Reason(StrEnum):
    """Why a release attempt failed or was refused, or how a job ended without being sent: the
    ``reason`` label of the release metrics and of the "release decision" log line."""

    # retryable: P or D's control endpoint did not answer as it should
    UNREACHABLE = "unreachable"
    HANDSHAKE_TIMEOUT = "handshake_timeout"
    BAD_REPLY = "bad_reply"
    NIXL_ERROR = "nixl_error"
    DNS_FAILURE = "dns_failure"
    TIMEOUT = "timeout"  # the control endpoint's answer did not come in time
    SERVER_ERROR = "server_error"  # the control endpoint answered 5xx
    THROTTLED = "throttled"  # ... 408 or 429
    TRANSPORT = "transport"  # ... broke the connection
    # permanent: refused before (or without) anything being sent
    UNKNOWN_VERSION = "unknown_version"
    UNKNOWN_WIRE = "unknown_wire"  # a vLLM newer than every known one: P's reply is not the newest wire
    INCONSISTENT_VERSION = "inconsistent_version"
    UNSAFE_VERSION = "unsafe_version"
    UNSAFE_RETRY = "unsafe_retry"
    NOT_ALLOWED = "not_allowed"
    NO_REQUEST_ID = "no_request_id"
    BAD_HOST = "bad_host"
    BAD_PORT = "bad_port"
    UNRESOLVABLE = "unresolvable"
    ENGINE_MISMATCH = "engine_mismatch"
    # the parameters claim ranks P does not have (P's own parameters, or another engine answering)
    TOPOLOGY_MISMATCH = "topology_mismatch"
    P_RESTARTED = "p_restarted"
    NO_PARAMS = "no_params"  # the http strategy has no raw parameters to hand on
    NO_PATH = "no_path"  # auto: neither NIXL nor D's control endpoint can carry it
    UNAUTHORIZED = "unauthorized"  # D's control endpoint refused the token (401)
    FORBIDDEN = "forbidden"  # ... 403
    NOT_FOUND = "not_found"  # ... 404/405: no plugin in D
    BAD_REQUEST = "bad_request"  # ... 400/413/422
    REJECTED = "rejected"  # ... another 4xx
    # the pipeline's own
    TARGET_DOWN = "target_down"  # the target's breaker stayed open until the deadline
    DEADLINE = "deadline"  # the deadline passed before or during an attempt
    CANCELLED = "cancelled"  # a shared handshake was abandoned by the job that began it
    BUG = "bug"  # an unexpected exception (logged with its traceback)
    RETRYABLE = "retryable"  # a retryable error that names no reason of its own
    PERMANENT = "permanent"  # a permanent error that names no reason of its own


class ReleaseError(SidecarError):
    """Base of every error a strategy raises for one job."""

    reason: Reason = Reason.RETRYABLE  # the metric label
    health: TargetHealth = TargetHealth.UP  # what the failure says about the target


class RetryableReleaseError(ReleaseError):
    """Worth trying again before the deadline: P unreachable, timeout, NIXL error."""

    reason = Reason.RETRYABLE


class PermanentReleaseError(ReleaseError):
    """Retrying cannot help: target not allowed, unknown vLLM release, bad parameters."""

    reason = Reason.PERMANENT
    health = TargetHealth.UNTOUCHED  # most are decided before connecting; those after say UP

    def __init__(
        self, message: str, reason: Reason = Reason.PERMANENT, health: TargetHealth | None = None
    ) -> None:
        super().__init__(message)
        self.reason = reason
        if health is not None:
            self.health = health
