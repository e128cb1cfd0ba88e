"""What P, D and the sidecar show about one scenario: parsed from their /metrics and P's log.

Pure functions and value types (tested in ``make test`` without vLLM). P's
evidence is its own: ``vllm:kv_cache_usage_perc`` (the pinned block),
``vllm:nixl_num_kv_expired_reqs_total`` (a lease ran out),
``vllm:nixl_num_notifications_after_expiry_total`` (a notification for an id
P no longer held: a duplicate or a late release), the failed-notification and
failed-transfer counters, and the log lines "Releasing expired KV blocks for
request ..." and "... unrecognized request ... were retrieved by a decode
worker". D's ``vllm:nixl_xfer_time_seconds_count`` says D read over NIXL; the
sidecar's ``kvr_releases_total`` says whether it sent a release.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from dataclasses import dataclass, field

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')
EXPIRED_LINE = re.compile(r"Releasing expired KV blocks for request (\S+) which were retrieved by (\d+)")
UNRECOGNIZED_LINE = re.compile(r"unrecognized request (\S+) were retrieved by a decode worker")

P_SERIES = {
    "usage": "vllm:kv_cache_usage_perc",
    "expired": "vllm:nixl_num_kv_expired_reqs_total",
    "after_expiry": "vllm:nixl_num_notifications_after_expiry_total",
    "failed_notifications": "vllm:nixl_num_failed_notifications_total",
    "failed_transfers": "vllm:nixl_num_failed_transfers_total",
    "finished": "vllm:request_success_total",
}
D_READS = "vllm:nixl_xfer_time_seconds_count"
PROMPT_TOKENS = "vllm:request_prompt_tokens"  # a histogram with 1-2-5 buckets


def samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    """Every sample of a Prometheus text exposition: (name, labels, value)."""
    found = []
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match is None or line.startswith("#"):
            continue
        try:
            value = float(match.group(3))
        except ValueError:
            continue
        labels = dict(_LABEL.findall(match.group(2) or ""))
        found.append((match.group(1), labels, value))
    return found


def totals(text: str) -> dict[str, float]:
    """Each series' value summed over its labels (one engine, one model: the sum is the value)."""
    summed: dict[str, float] = defaultdict(float)
    for name, _, value in samples(text):
        summed[name] += value
    return dict(summed)


def by_label(text: str, name: str, label: str) -> dict[str, float]:
    """The samples of ``name`` keyed by the value of ``label``."""
    keyed: dict[str, float] = defaultdict(float)
    for sample, labels, value in samples(text):
        if sample == name:
            keyed[labels.get(label, "")] += value
    return dict(keyed)


@dataclass(frozen=True)
class PView:
    """P's /metrics at one moment."""

    usage: float = 0.0
    expired: float = 0.0
    after_expiry: float = 0.0
    failed_notifications: float = 0.0
    failed_transfers: float = 0.0
    finished: float = 0.0
    prefills: float = 0.0  # requests of more than 5 prompt tokens P has served (not one-token pokes)

    @classmethod
    def parse(cls, text: str) -> PView:
        summed = totals(text)
        if P_SERIES["expired"] not in summed:
            raise ValueError("P's /metrics has no vllm:nixl_* counters: P runs no NIXL connector")
        short = by_label(text, PROMPT_TOKENS + "_bucket", "le").get("5.0", 0.0)
        prefills = summed.get(PROMPT_TOKENS + "_count", 0.0) - short
        return cls(**{key: summed.get(name, 0.0) for key, name in P_SERIES.items()}, prefills=prefills)


def d_reads(text: str) -> float:
    """How many NIXL reads D has made (its transfer-time histogram's count)."""
    return totals(text).get(D_READS, 0.0)


def sidecar_results(text: str) -> dict[str, float]:
    """The sidecar's finished release jobs by result (``sent``, ``covered_by_engine``, ...)."""
    return by_label(text, "kvr_releases_total", "result")


def sidecar_requests(text: str) -> float:
    """How many requests the sidecar has answered or seen its client leave (``kvr_requests_total``)."""
    return totals(text).get("kvr_requests_total", 0.0)


def sidecar_not_released(text: str) -> dict[str, float]:
    """The sidecar's rejections it did not release, by outcome (``retryable``, ``admitted``, ...)."""
    return by_label(text, "kvr_not_released_total", "outcome")


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, int]:
    """What rose between two readings of a labelled counter (zero entries left out)."""
    rose = {key: round(value - before.get(key, 0.0)) for key, value in after.items()}
    return {key: count for key, count in rose.items() if count}


@dataclass(frozen=True)
class PLog:
    """P's log lines about one scenario's request(s)."""

    expired: tuple[str, ...] = ()  # request ids P released when their lease ran out
    unrecognized: tuple[str, ...] = ()  # request ids notified after P stopped holding them
    lines: tuple[str, ...] = field(default=(), repr=False)

    @classmethod
    def parse(cls, text: str) -> PLog:
        expired, unrecognized, lines = [], [], []
        for line in text.splitlines():
            if match := EXPIRED_LINE.search(line):
                expired.append(match.group(1))
                lines.append(line.strip())
            elif match := UNRECOGNIZED_LINE.search(line):
                unrecognized.append(match.group(1))
                lines.append(line.strip())
        return cls(tuple(expired), tuple(unrecognized), tuple(lines))


@dataclass
class Evidence:
    """Everything observed about one scenario, as the verdict and the report read it."""

    status: int = 0
    answered_by: str = "D"  # "D", or "sidecar" when the sidecar answered itself ("nobody": no answer)
    # The client's request failed without an answer (``httpx``'s error), and how many requests the
    # sidecar counted meanwhile (``kvr_requests_total``): 0 means it never read this one.
    transport_error: str | None = None
    sidecar_requests: int = 0
    body: str = ""  # the start of the answer
    error_type: str | None = None
    error_param: str | None = None
    stream_error: int | None = None  # the code of an error event in a 200 stream
    pinned: bool = False  # P held blocks for the request (or, router mode, served its prefill leg)
    prefills: int = 0  # the prefills P ran for the request (a routed mode's front; 0: not counted)
    freed_after: float | None = None  # seconds from the pin until P held no block, None: never seen
    first_poll: float = 0.0  # seconds from the pin to the harness's first look at P's usage
    expired: int = 0
    after_expiry: int = 0
    failed_notifications: int = 0
    failed_transfers: int = 0
    p_log: PLog = field(default_factory=PLog)
    d_reads: int = 0
    sidecar: dict[str, int] = field(default_factory=dict)
    not_released: dict[str, int] = field(default_factory=dict)  # kvr_not_released_total by outcome
    same_output: bool | None = None  # admitted: the P/D answer equals D's own, token for token
    output: str = ""  # the P/D answer (``tests.e2e.answers.Output.summary``)
    reference: str = ""  # D's own answer to the same prompt
    output_differences: list[str] = field(default_factory=list)
    logprob_gap: float | None = None  # the largest difference of a token's logprob from D's own
    lease: float = 0.0
    stall: float = 0.0  # the longest the machine stalled during the scenario (``tests.e2e.stalls``)
    harness_stall: float = 0.0  # the part of ``stall`` the harness itself saw (its own thread)
    window_stall: float = 0.0  # the longest stall inside the release window (pin to lease end)
    load: float = 0.0  # the machine's load average (1 minute) when the scenario ended
    notes: list[str] = field(default_factory=list)

    @property
    def sidecar_sent(self) -> int:
        return self.sidecar.get("sent", 0)

    @property
    def d_notified(self) -> bool | None:
        """Whether D itself notified P, as P's evidence and the sidecar's count tell it."""
        if self.d_reads:
            return True
        if self.sidecar_sent:  # one notification was the sidecar's; a second one was D's
            return None if self.expired else self.after_expiry > 0
        if self.after_expiry or (self.freed_after is not None and not self.expired):
            return True  # the only notification P got (if after its lease: D's, late)
        return False if self.expired else None


@dataclass(frozen=True)
class ErrorShape:
    """The error an answer carries: ``{"error": {"type", "param", "code"}}`` in a body or an SSE event."""

    type: str | None = None
    param: str | None = None
    code: int | None = None
    in_stream: bool = False  # the error came as an event of a 200 stream


def error_shape(body: bytes) -> ErrorShape:
    """The first error in a JSON body or an SSE stream (an empty shape when there is none)."""
    text = body.decode(errors="replace").strip()
    if text.startswith("data:"):
        for line in text.splitlines():
            payload = line[5:].strip() if line.startswith("data:") else ""
            if payload.startswith("{") and '"error"' in payload:
                shape = _shape(payload)
                return ErrorShape(shape.type, shape.param, shape.code, in_stream=True)
        return ErrorShape()
    return _shape(text)


def _shape(text: str) -> ErrorShape:
    try:
        payload = json.loads(text)
    except ValueError:
        return ErrorShape()
    error = payload.get("error") if isinstance(payload, dict) else None
    if not isinstance(error, dict):
        return ErrorShape()
    code = error.get("code")
    param = error.get("param")
    return ErrorShape(
        error.get("type") if isinstance(error.get("type"), str) else None,
        param if isinstance(param, str) else None,
        code if isinstance(code, int) else None,
    )
