"""The verdict of a run: did any release reach P for a request D admitted, and did every
admitted request get its tokens? A pure function of what the run measured.

The simulators know both sides. D's ``/sim/log`` says which requests it
admitted; P's ``/sim/requests/{id}`` says how many notifications each rank
got for a request, and ``notifs_unknown`` counts notifications for ids P no
longer held. D notifies each P rank once per admitted request, so a rank
notified more than once for an admitted request, or any notification for an
unknown id, is a wrong or double release: either a release reached P for a
request D admitted (before D read: silently wrong output; after: P logs an
error), or a rejected request was released twice. P cannot tell those
apart, so both fail the run. Against a real vLLM P, only its count of
notifications for unknown ids would show it, where the release exports one;
it is reported, and its absence is said. A request D admitted (by D's log,
else by its answer) that ended without its tokens fails the run as well.

A run cannot pass by testing nothing: one where D admitted no request, or
where D rejected more than ``max_rejected_share`` of the requests it was sent
for reasons the sidecar did not inject, fails, and the verdict names the
main cause in one line (``D rejected 190 of 232 (82%, ...): 404 model not
found (P serves 'x', D 'y')``). The demo and ``kv-release-sidecar loadtest``
(the loadtest Job) judge with this same function.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sidecar.loadtest.flow import REJECTED, FlowResult

LogEntry = Mapping[str, Any]


@dataclass(frozen=True)
class Evidence:
    """Everything the verdict reads; ``None`` where the run could not measure it."""

    flows: Sequence[FlowResult]
    p_kind: str  # "simulator" or "prometheus"
    p_delta: Mapping[str, float]  # P's counters over the run
    d_log: Mapping[str, LogEntry] | None = None  # D's log by request id (the simulator)
    p_requests: Mapping[str, LogEntry | None] | None = None  # P's record by P's id (the simulator)
    sidecar_delta: Mapping[str, float] | None = None  # the sidecar's counters over the run
    max_rejected_share: float = 1.0  # D's rejections (not injected) above this share fail the run
    p_model: str = ""  # the model the run asked for (P's)
    d_model: str | None = None  # the first model D lists, when it answered /v1/models


@dataclass(frozen=True)
class Verdict:
    """PASS or FAIL, the reasons, and what could not be checked."""

    ok: bool
    problems: tuple[str, ...]
    notes: tuple[str, ...]
    wrong_releases: int  # admitted requests a P rank was notified for more than once
    unknown_notifications: float | None  # None: P does not count them
    admitted_without_tokens: int

    @property
    def line(self) -> str:
        """The one-line verdict printed at the end of a run."""
        if self.ok:
            return "verdict: PASS - no wrong release seen, every admitted request got its tokens"
        return "verdict: FAIL - " + "; ".join(self.problems)


def was_admitted(flow: FlowResult, d_log: Mapping[str, LogEntry] | None) -> bool:
    """D's log when it has the request, else the answer: a 200 that did not open with an error."""
    entry = d_log.get(flow.request_id) if d_log is not None else None
    if entry is not None:
        return bool(entry.get("admitted"))
    if d_log is not None and flow.decode_status not in (0, 200):
        return False  # never reached D (down, injected) or refused before D's log
    return flow.decode_status == 200 and flow.outcome != "stream_rejected" and not flow.injected


def judge(evidence: Evidence) -> Verdict:
    """The verdict of one run (see the module docstring)."""
    problems: list[str] = []
    notes: list[str] = []
    admitted = [flow for flow in evidence.flows if was_admitted(flow, evidence.d_log)]
    starved = [flow for flow in admitted if flow.outcome != "ok"]
    if starved:
        example = f"{starved[0].request_id}: {starved[0].detail or starved[0].outcome}"
        problems.append(f"{len(starved)} request(s) D admitted ended without their tokens (e.g. {example})")
    wrong = _notified_twice(admitted, evidence.p_requests)
    if wrong:
        problems.append(f"{len(wrong)} request(s) D admitted were notified more than once on a P rank")
    unknown = evidence.p_delta.get("notifs_unknown")
    if unknown:
        problems.append(
            f"P got {unknown:.0f} notification(s) for request ids it no longer held: a wrong or double "
            "release (a release for a request D admitted, or a second release of a rejected one)"
        )
    problems += _vacuous(evidence, admitted)
    problems += _sidecar_problems(evidence)
    notes += _notes(evidence, admitted)
    return Verdict(
        ok=not problems,
        problems=tuple(problems),
        notes=tuple(notes),
        wrong_releases=len(wrong),
        unknown_notifications=unknown,
        admitted_without_tokens=len(starved),
    )


def _vacuous(evidence: Evidence, admitted: Sequence[FlowResult]) -> list[str]:
    """What makes a run prove nothing: no request admitted, or D rejecting (not by injection)
    more than the allowed share of what it was sent."""
    flows = evidence.flows
    sent = [flow for flow in flows if flow.decode_status or flow.outcome in REJECTED]
    rejected = [flow for flow in sent if flow.outcome in REJECTED and not flow.injected]
    problems = []
    if not admitted:
        problems.append(f"D admitted none of the {len(flows)} flow(s)" + _p_cause(flows, sent))
    share = len(rejected) / len(sent) if sent else 0.0
    if rejected and share > evidence.max_rejected_share:
        problems.append(
            f"D rejected {len(rejected)} of {len(sent)} ({share:.0%}, over --max-rejected-share "
            f"{evidence.max_rejected_share:.0%}): {_main_cause(rejected, evidence)}"
        )
    return problems


def _p_cause(flows: Sequence[FlowResult], sent: Sequence[FlowResult]) -> str:
    """Why flows never reached D (P refused or failed them), when none did."""
    if sent or not flows:
        return ""
    first = flows[0]
    if first.prefill_status == 200:
        return f": no decode leg got an answer ({first.detail or first.outcome})"
    return f": P answered {first.prefill_status or 'nothing'} ({first.detail or first.outcome})"


def _main_cause(rejected: Sequence[FlowResult], evidence: Evidence) -> str:
    causes = Counter(_cause(flow, evidence) for flow in rejected)
    cause, count = causes.most_common(1)[0]
    return cause if count == len(rejected) else f"mostly {cause} ({count})"


def _cause(flow: FlowResult, evidence: Evidence) -> str:
    """One rejection's cause, short and stable enough to count alike ones together."""
    if flow.outcome == "stream_rejected":
        return f"200 then an error event {flow.stream_error} ({flow.error_type or 'no type'})"
    detail = flow.detail.lower()
    if flow.decode_status == 404 and "model" in detail:
        d_model = evidence.d_model
        if d_model is not None and d_model != evidence.p_model:
            return f"404 model not found (P serves '{evidence.p_model}', D '{d_model}')"
        return "404 model not found"
    return f"{flow.decode_status} {flow.error_type or 'without a type'}: {flow.detail[:80]}"


def _notified_twice(
    admitted: Sequence[FlowResult], p_requests: Mapping[str, LogEntry | None] | None
) -> list[str]:
    if p_requests is None:
        return []
    wrong = []
    for flow in admitted:
        record = p_requests.get(flow.p_request_id or "")
        if record is not None and any(count > 1 for count in record.get("notification_counts", ())):
            wrong.append(flow.request_id)
    return wrong


def _sidecar_problems(evidence: Evidence) -> list[str]:
    if evidence.sidecar_delta is None:
        return []
    problems = []
    sent = evidence.sidecar_delta.get("releases.sent", 0.0)
    rejected = sum(1 for flow in evidence.flows if flow.outcome in REJECTED and flow.blocks)
    if sent > rejected:
        problems.append(
            f"the sidecar sent {sent:.0f} releases for {rejected} rejected request(s) holding blocks"
        )
    # A release the strategy refused (allowlist, version) or gave up on left P's blocks to its
    # lease: the memory this run is meant to prove comes back did not.
    for result, why in (
        ("refused", "refused (allowlist? vLLM release?)"),
        ("failed", "failed at the deadline"),
    ):
        count = evidence.sidecar_delta.get(f"releases.{result}", 0.0)
        if count:
            problems.append(
                f"{count:.0f} release(s) {why}: P kept those blocks until its lease (kvr_releases_total)"
            )
    return problems


def _notes(evidence: Evidence, admitted: Sequence[FlowResult]) -> list[str]:
    notes = []
    if evidence.d_log is None:
        notes.append("D is not the simulator: 'admitted' is judged from D's answers")
    if evidence.p_kind != "simulator":
        notes.append("P is not the simulator: per-request notification counts cannot be checked")
    if evidence.p_delta.get("notifs_unknown") is None:
        notes.append(
            "P exports no count of notifications for unknown ids: look for 'unrecognized request' "
            "in P's log to see wrong or double releases"
        )
    if evidence.p_requests is not None:
        expired = [
            flow.request_id
            for flow in admitted
            if (evidence.p_requests.get(flow.p_request_id or "") or {}).get("freed_by") == "expiry"
        ]
        if expired:
            notes.append(
                f"{len(expired)} request(s) D admitted were freed by P's lease, not by D's notification "
                "(D does not speak NIXL, or read too late)"
            )
    return notes
