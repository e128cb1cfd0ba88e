"""The NIXL side of a release: P's side channel (ZMQ) and the sidecar's own NIXL agent.

Modules: ``versions`` (which wire format a vLLM release speaks), ``messages``
(every side-channel message as a msgspec Struct), ``handshake`` (the async ZMQ
REQ client, the target check and the handshake cache), ``peer`` (the NIXL
agent on its own thread), ``session`` (the handshakes shared, cached,
invalidated, dropped and swept), ``lineage`` (which P process holds the
blocks) and ``metrics``. ``sidecar.release.nixl`` composes them into the
``nixl`` release strategy.

Every failure is translated once, where it happens, into this tree (the
``reason`` is the metric label)::

    ReleaseError                              sidecar.release.base
    +-- RetryableReleaseError                 the pipeline retries until the deadline
    |   +-- PeerUnreachable    "unreachable"        connection refused or dropped, DNS failure
    |   +-- HandshakeTimeout   "handshake_timeout"  no reply within config.handshake_timeout
    |   +-- BadReply           "bad_reply"          wrong frame count, undecodable payload
    |   +-- NixlError          "nixl_error"         add_remote_agent / send_notif failed
    |   +-- ResolveFailed      "dns_failure"        (sidecar.network.resolver) no DNS answer now
    +-- PermanentReleaseError                 never retried; reasons listed in REFUSALS
        +-- EngineMismatch     "engine_mismatch"    rank (0, 0)'s engine_id is not remote_engine_id
        +-- TopologyMismatch   "topology_mismatch"  the parameters claim ranks P does not have
        +-- PRestarted         "p_restarted"        P came back as a new process (``lineage``)
        +-- UnknownWire        "unknown_wire"       a vLLM newer than every known one, whose reply
                                                    does not decode under the newest known wire
"""

from __future__ import annotations

from sidecar.exceptions import PermanentReleaseError, Reason, RetryableReleaseError, TargetHealth

#: ``PermanentReleaseError.reason`` values the NIXL strategy uses.
REFUSALS = (
    Reason.UNKNOWN_VERSION,  # no release known (no --vllm-version, D's /version unusable)
    Reason.UNKNOWN_WIRE,  # a newer vLLM's handshake reply does not decode as the newest known wire
    Reason.INCONSISTENT_VERSION,  # kv_transfer_params contradict the release
    Reason.UNSAFE_VERSION,  # 0.9.x / 0.10.0 without --allow-unsafe-vllm
    Reason.UNSAFE_RETRY,  # 0.9.x / 0.10.0: a send was attempted once already
    Reason.NOT_ALLOWED,  # P's endpoint is outside --prefill-allow
    Reason.NO_REQUEST_ID,  # P's id for the request cannot be known
    Reason.BAD_HOST,  # remote_host is neither an IP address nor a DNS name
    Reason.BAD_PORT,  # a side-channel port past 65535
    Reason.UNRESOLVABLE,  # remote_host names no address (NXDOMAIN)
    Reason.ENGINE_MISMATCH,  # P's side channel serves another engine: the one named is gone
    Reason.TOPOLOGY_MISMATCH,  # the parameters claim ranks P does not have
    Reason.P_RESTARTED,  # the request's P process is gone; a new one answers there (lineage)
)
#: ``RetryableReleaseError.reason`` values the NIXL strategy uses (``kvr_nixl_errors_total{reason}``).
RETRIES = (
    Reason.UNREACHABLE,  # PeerUnreachable
    Reason.HANDSHAKE_TIMEOUT,  # HandshakeTimeout
    Reason.BAD_REPLY,  # BadReply
    Reason.NIXL_ERROR,  # NixlError
    Reason.DNS_FAILURE,  # sidecar.network.resolver.ResolveFailed: P's host name got no answer now
)


class PeerUnreachable(RetryableReleaseError):
    """P's side channel refused or dropped the connection, or its name did not resolve."""

    reason = Reason.UNREACHABLE
    health = TargetHealth.DOWN


class HandshakeTimeout(RetryableReleaseError):
    """P's side channel did not answer within the handshake timeout."""

    reason = Reason.HANDSHAKE_TIMEOUT
    health = TargetHealth.DOWN


class BadReply(RetryableReleaseError):
    """P's reply had the wrong number of frames or could not be decoded."""

    reason = Reason.BAD_REPLY


class EngineMismatch(PermanentReleaseError):
    """Rank (0, 0) answered for another engine than ``remote_engine_id``.

    Permanent: the engine the parameters name does not serve there (P restarted, the address
    now belongs to another P, or the id is forged), so there are no blocks of it to free;
    retrying would only load that P's side channel with handshakes until the deadline. Nothing
    more is asked of P: rank (0, 0) is asked alone, first (``sidecar.nixl.handshake``).
    """

    health = TargetHealth.UP  # something answered there: the endpoint itself is alive

    def __init__(self, message: str) -> None:
        super().__init__(message, Reason.ENGINE_MISMATCH)


class TopologyMismatch(PermanentReleaseError):
    """The parameters claim ranks P does not have: more than P's own parameters named for the P
    process at that address, or a worker of another engine answers at a claimed rank's port.

    Permanent, and nothing more is asked of P: a request for a rank P lacks ends vLLM's
    side-channel listener (0.11.1+), and with it every later handshake with that P.
    """

    def __init__(self, message: str, health: TargetHealth = TargetHealth.UNTOUCHED) -> None:
        super().__init__(message, Reason.TOPOLOGY_MISMATCH, health)


class PRestarted(PermanentReleaseError):
    """The P process that held the request's blocks is gone, and a new one answers at its address
    (``sidecar.nixl.lineage``): its notification would name an id the new P never held."""

    health = TargetHealth.UP  # the new P answered: the endpoint is alive

    def __init__(self, message: str) -> None:
        super().__init__(message, Reason.P_RESTARTED)


class UnknownWire(PermanentReleaseError):
    """P runs a vLLM newer than every release this sidecar knows, and its handshake reply does not
    decode under the newest known wire: the format changed, and nothing is sent to P."""

    health = TargetHealth.UP  # P answered

    def __init__(self, message: str) -> None:
        super().__init__(message, Reason.UNKNOWN_WIRE)


class NixlError(RetryableReleaseError):
    """A NIXL call failed (bad metadata, remote disconnected, agent not started)."""

    reason = Reason.NIXL_ERROR


__all__ = [
    "REFUSALS",
    "RETRIES",
    "BadReply",
    "EngineMismatch",
    "HandshakeTimeout",
    "NixlError",
    "PRestarted",
    "PeerUnreachable",
    "TopologyMismatch",
    "UnknownWire",
]
