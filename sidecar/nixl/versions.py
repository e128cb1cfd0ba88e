"""Which side-channel wire format a vLLM release speaks, chosen from the release, never by trial.

A malformed handshake request kills P's side-channel listener thread for good
(vLLM's listener loop catches only its receive timeout), so the format is
derived from the version string alone and then
checked against the ``kv_transfer_params`` P emitted (its scheduler's ``request_finished``): a
field P always sends from release X on must be present from X and absent
before. ``WireProfile.for_version`` returns ``None`` for anything unknown;
``check_params`` returns why the parameters contradict the release.

A release newer than the newest known one (``NEWEST``) is unknown, and what
it gets is a setting (``UnknownPolicy``): ``"newest"`` (the default) gives it
the newest known profile, marked ``assumed``, so P's handshake reply is decoded
under the newest known wire before anything is sent (``sidecar.release.nixl``
refuses the job as ``unknown_wire`` when it does not decode); ``"refuse"``
gives it no profile. A notification naming an id P does not hold is logged
and ignored since 0.10.1 (the blocks stay to the lease, as with no sidecar);
what the default cannot check before sending, the handshake request's framing
and the notification's format, is in docs/vllm-releases.md.

A pre-release (``0.26.0rc1``, ``0.21.0.dev3+g...``) holds code from anywhere
between the previous release and the one it leads to: it gets a profile only
when the wire format is the same at both ends, and the range is kept for the
consistency check (``low`` is the previous release, ``high`` the next one).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from sidecar.params import ReleaseParams

Version = tuple[int, int, int]
RequestEncoding = Literal["raw", "tp", "pp_tp"]
Listener = Literal["worker", "scheduler"]
Payload = Literal["agent_metadata", "handshake_payload"]
NotificationFormat = Literal["bare", "count"]
#: What a release newer than ``NEWEST`` gets: the newest known profile (checked against P's
#: handshake reply), or none.
UnknownPolicy = Literal["newest", "refuse"]

OLDEST: Version = (0, 9, 0)
NEWEST: Version = (0, 34, 0)
#: The known span, as docs and messages state it.
KNOWN = f"{'.'.join(map(str, OLDEST))}-{'.'.join(map(str, NEWEST))}"
#: vLLM releases on PyPI in the supported span (post releases such as 0.10.1.1 fold into 0.10.1).
RELEASES: tuple[Version, ...] = (
    (0, 9, 0), (0, 9, 1), (0, 9, 2), (0, 10, 0), (0, 10, 1), (0, 10, 2), (0, 11, 0),
    (0, 11, 1), (0, 11, 2), (0, 12, 0), (0, 13, 0), (0, 14, 0), (0, 14, 1), (0, 15, 0),
    (0, 15, 1), (0, 16, 0), (0, 17, 0), (0, 17, 1), (0, 18, 0), (0, 18, 1), (0, 19, 0),
    (0, 19, 1), (0, 20, 0), (0, 20, 1), (0, 20, 2), (0, 21, 0), (0, 22, 0), (0, 22, 1),
    (0, 23, 0), (0, 24, 0), (0, 25, 0), (0, 25, 1), (0, 26, 0), (0, 27, 0), (0, 27, 1),
    (0, 28, 0), (0, 29, 0), (0, 30, 0), (0, 31, 0), (0, 32, 0), (0, 33, 0), (0, 34, 0),
)  # fmt: skip

_VERSION_RE = re.compile(
    r"^v?([0-9]{1,6})\.([0-9]{1,6})(?:\.([0-9]{1,6}))?(?:\.([0-9]{1,6}))?(?P<rest>[^+]*)(?:\+.*)?$"
)
_PRE_RE = re.compile(r"^(?:\.?(?:a|b|rc)\d*)?(?:\.?dev\d*)?$")
_POST_RE = re.compile(r"^(?:\.?post\d*)?$")


@dataclass(frozen=True, slots=True)
class ParsedVersion:
    """A version string reduced to its release tuple; ``pre`` for rc/dev/alpha/beta builds."""

    release: Version
    pre: bool


def parse_version(text: str) -> ParsedVersion | None:
    """``"0.21.0"`` -> (0, 21, 0); ``"0.10.1.1"`` (post) -> (0, 10, 1); garbage -> None."""
    match = _VERSION_RE.match(text.strip())
    if match is None:
        return None
    release = (int(match[1]), int(match[2]), int(match[3] or 0))
    rest = match["rest"]
    if _POST_RE.match(rest):
        return ParsedVersion(release, pre=False)
    if _PRE_RE.match(rest):
        return ParsedVersion(release, pre=True)
    return None


def _request(v: Version) -> RequestEncoding:
    if v < (0, 11, 1):
        return "raw"  # the bytes b"get_meta_msg"
    return "tp" if v < (0, 26, 0) else "pp_tp"


@dataclass(frozen=True, slots=True)
class WireFormat:
    """The parts of a profile that must not differ between the ends of a pre-release range."""

    request: RequestEncoding  # 1.2
    reply_frames: int  # 1.3: 1, or 2 (payload + P's perf_counter) from 0.26.0
    listener: Listener  # 1.1: one per worker at base+tp_rank, or one per engine at base
    payload: Payload  # 1.4: NixlAgentMetadata, or NixlHandshakePayload wrapping it (0.13.0+)
    notification: NotificationFormat  # 2.2: "<id>" (0.9.0) or "<id>:1"
    has_remote_request_id: bool  # 3.1: remote_request_id names P's request (0.13.0+)
    pp_on_pull: bool  # 1.5: D queries every PP rank on pull (0.29.0+); else PP rank 0 only

    @classmethod
    def of(cls, v: Version) -> WireFormat:
        return cls(
            request=_request(v),
            reply_frames=2 if v >= (0, 26, 0) else 1,
            listener="worker" if v < (0, 11, 1) else "scheduler",
            payload="agent_metadata" if v < (0, 13, 0) else "handshake_payload",
            notification="bare" if v < (0, 9, 1) else "count",
            has_remote_request_id=v >= (0, 13, 0),
            pp_on_pull=v >= (0, 29, 0),
        )


@dataclass(frozen=True, slots=True)
class WireProfile:
    """Everything the release path needs to know about P's vLLM release."""

    text: str  # as given (for logs)
    low: Version  # oldest release the code may be (== high for a release)
    high: Version
    wire: WireFormat
    safe_unknown_id: bool  # a notification for an id P dropped only logs (0.10.1+); before, P's engine dies
    engine_fix: bool  # D releases its own handler rejections (0.21.0+, notify_kv_transfer_request_rejected)
    #: A release newer than ``NEWEST`` given ``NEWEST``'s profile (``UnknownPolicy`` "newest"):
    #: P's handshake reply must decode under it before anything is sent.
    assumed: bool = False

    @classmethod
    def for_version(cls, text: str, unknown: UnknownPolicy = "refuse") -> WireProfile | None:
        """The profile of ``text``, or None when the release is unknown or ambiguous; with
        ``unknown="newest"`` a release newer than every known one gets ``newest_for``."""
        parsed = parse_version(text)
        if parsed is None:
            return None
        high = parsed.release
        low = _previous_release(high) if parsed.pre else high
        if unknown == "newest" and is_newer(parsed):
            return cls.newest_for(text)
        if low is None or low < OLDEST or high > NEWEST or (not parsed.pre and high < OLDEST):
            return None
        wire = WireFormat.of(low)
        if WireFormat.of(high) != wire:
            return None  # a pre-release that straddles a wire-format change
        return cls(
            text=text,
            low=low,
            high=high,
            wire=wire,
            safe_unknown_id=low >= (0, 10, 1),
            engine_fix=low >= (0, 21, 0),  # conservative: the fix may be newer than a pre-release
        )

    @classmethod
    def newest_for(cls, text: str) -> WireProfile:
        """``NEWEST``'s profile for a release newer than it, marked ``assumed``."""
        return cls(
            text=text,
            low=NEWEST,
            high=NEWEST,
            wire=WireFormat.of(NEWEST),
            safe_unknown_id=True,
            engine_fix=True,
            assumed=True,
        )

    def port(self, base_port: int, tp_rank: int) -> int:
        """Where rank ``tp_rank``'s metadata is served (1.1); ``remote_port`` is the base."""
        return base_port + tp_rank if self.wire.listener == "worker" else base_port

    def ranks(self, params: ReleaseParams) -> list[tuple[int, int]]:
        """Every (pp_rank, tp_rank) holding blocks, only below tp_size/pp_size (1.5)."""
        pp_size = (params.pp_size or 1) if self.wire.pp_on_pull else 1
        return [(pp, tp) for pp in range(pp_size) for tp in range(params.tp_size)]


def is_newer(parsed: ParsedVersion) -> bool:
    """Whether ``parsed`` is past every known release: a release after ``NEWEST``, or a
    pre-release leading to one (its code is from after ``NEWEST``)."""
    return parsed.release > NEWEST


def newer_than_known(text: str | None) -> bool:
    """Whether ``text`` names a vLLM release newer than every release this sidecar knows."""
    parsed = parse_version(text) if text else None
    return parsed is not None and is_newer(parsed)


def _previous_release(version: Version) -> Version | None:
    older = [r for r in RELEASES if r < version]
    return older[-1] if older else None


@dataclass(frozen=True, slots=True)
class FieldRule:
    """A ``kv_transfer_params`` field P sends in every pull request from ``since`` on."""

    field: str
    since: Version


RULES = (
    FieldRule("remote_request_id", (0, 13, 0)),
    FieldRule("nested remote_block_ids", (0, 18, 0)),  # BlockIds, one list per KV cache group
    FieldRule("remote_num_tokens", (0, 21, 0)),
    FieldRule("transfer_mode", (0, 28, 0)),
    FieldRule("pp_size", (0, 29, 0)),  # pull; push sends it from 0.26.0 but is never released
    FieldRule("dcp_size", (0, 29, 0)),
    FieldRule("remote_registration_generation", (0, 33, 0)),
)


def _present(params: ReleaseParams, field: str) -> bool:
    """Whether P sent ``field``."""
    if field == "nested remote_block_ids":
        return params.grouped
    return getattr(params, field) is not None


def _dotted(version: Version) -> str:
    return ".".join(map(str, version))


def check_params(profile: WireProfile, params: ReleaseParams) -> str:
    """Why ``params`` cannot come from ``profile``'s release, or "" when they can.

    ``tp_size`` (0.9.2+) cannot be checked: the decoded parameters default it.
    """
    for rule in RULES:
        present = _present(params, rule.field)
        if present and profile.high < rule.since:
            return f"{rule.field} is present, but P sends it only from vLLM {_dotted(rule.since)}"
        if not present and profile.low >= rule.since:
            return f"{rule.field} is absent, but P sends it in every request from vLLM {_dotted(rule.since)}"
    return ""


def engine_request_id(
    profile: WireProfile,
    params: ReleaseParams,
    x_request_id: str,
    route: str,
    body_request_id: str | None = None,
) -> str | None:
    """The id P knows the request by (the id a "done" notification must name), or None when unknown.

    0.13.0+: ``remote_request_id``. Before, D's own id, which a router makes
    equal to P's by sending both the same ``X-Request-Id``: ``chatcmpl-<id>``
    (chat) and ``cmpl-<id>-0`` (first prompt of a completion), vllm 0.9.2-0.12.0
    ``entrypoints/openai/serving_chat.py`` and ``serving_completion.py``. The
    0.10.0-0.12.0 responses handler ignores ``X-Request-Id``: it uses the body's
    ``request_id`` field (default ``resp_<random>``, ``protocol.py``,
    ``serving_responses.py``), which the job carries as ``body_request_id``
    when the client set it (a default one is random on each server, so
    unknowable).
    """
    if profile.wire.has_remote_request_id:
        return params.remote_request_id or None
    if route == "/v1/responses":
        return body_request_id or None
    if not x_request_id:
        return None
    if route in ("/v1/chat/completions", "/v1/messages"):  # /v1/messages runs the chat handler
        return f"chatcmpl-{x_request_id}"
    if route == "/v1/completions":
        return f"cmpl-{x_request_id}-0"
    return None
