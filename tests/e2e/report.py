"""``out/e2e/report.json`` and the printed table: one line per scenario, with P's evidence.

The run's result is ``pass`` only when every scenario passed, the output
control was detected (``tests.e2e.controls``: D read another request's
blocks, and the output check failed it), no attempt of
any scenario failed for a reason other than time (``tests.e2e.verdict``:
such a failure is never run again, so this holds by construction and is
checked anyway), the negative control failed as it must (a sidecar with
releases off leaves the block to P's lease), and every difference from the
simulator is known. A scenario that passed only on a later attempt is marked
``retried`` in the report and the table, with each failed attempt's kinds,
problems and the stall measured in its release window. A run that stopped
early is ``error`` and lists no verdict it did not reach.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from tests.e2e.controls import OutputControl, summary
from tests.e2e.evidence import Evidence
from tests.e2e.scenarios import Mode, Scenario
from tests.e2e.simcompare import Comparison
from tests.e2e.verdict import TIMING, Kind, Problem, kinds_of


@dataclass(frozen=True)
class Attempt:
    """A failed attempt at a scenario that was run again (``tests.e2e.verdict.retry_allowed``)."""

    kinds: tuple[Kind, ...]
    problems: tuple[str, ...]
    window_stall: float  # the longest stall inside its release window, seconds
    stall: float
    load: float

    @classmethod
    def of(cls, problems: list[Problem], ev: Evidence) -> Attempt:
        return cls(
            tuple(kinds_of(problems)),
            tuple(map(str, problems)),
            ev.window_stall,
            ev.stall,
            ev.load,
        )

    @property
    def timing_only(self) -> bool:
        return bool(self.kinds) and set(self.kinds) <= TIMING

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "kinds": [str(kind) for kind in self.kinds]}


@dataclass
class Row:
    """One scenario's run in one mode, its verdict (the last attempt's) and the failed attempts before."""

    mode: Mode
    scenario: Scenario
    evidence: Evidence
    problems: list[Problem]
    attempts: list[Attempt] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.problems

    @property
    def retried(self) -> bool:
        return bool(self.attempts)

    @property
    def non_timing(self) -> bool:
        """Whether any attempt, the last one included, failed for a reason other than time."""
        last = set(kinds_of(self.problems))
        return not last <= TIMING or any(not attempt.timing_only for attempt in self.attempts)

    def as_dict(self) -> dict[str, Any]:
        ev = self.evidence
        return {
            "mode": self.mode,
            "scenario": self.scenario.key,
            "title": self.scenario.title,
            "group": self.scenario.group,
            "route": self.scenario.route,
            "stream": self.scenario.stream,
            "expect": str(self.scenario.expectation(self.mode)),
            "expected_status": self.scenario.expected_status(),
            "passed": self.passed,
            "problems": [str(problem) for problem in self.problems],
            "kinds": [str(kind) for kind in kinds_of(self.problems)],
            "retried": self.retried,
            "failed_attempts": [attempt.as_dict() for attempt in self.attempts],
            "evidence": {
                **{k: v for k, v in asdict(ev).items() if k not in ("p_log", "body")},
                "body": ev.body[:400],
                "p_log": {"expired": list(ev.p_log.expired), "unrecognized": list(ev.p_log.unrecognized)},
                "p_log_lines": list(ev.p_log.lines),
                "d_notified": ev.d_notified,
            },
        }


@dataclass
class Report:
    """Everything one run found; ``result`` decides the exit code."""

    rows: list[Row] = field(default_factory=list)
    control: Row | None = None
    output_control: OutputControl | None = None
    comparisons: list[Comparison] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)
    error: str = ""

    @property
    def control_failed(self) -> bool:
        """The negative control failed with P's lease freeing the block (the harness can see a failure)."""
        return self.control is not None and not self.control.passed and self.control.evidence.expired > 0

    @property
    def result(self) -> str:
        if self.error or not self.rows:
            return "error"
        ok = all(row.passed and not row.non_timing for row in self.rows) and all(
            c.ok for c in self.comparisons
        )
        ok = ok and (self.output_control is None or self.output_control.detected)
        return "pass" if ok and (self.control is None or self.control_failed) else "fail"

    def as_dict(self) -> dict[str, Any]:
        return {
            "result": self.result,
            "error": self.error,
            "retried_rows": [f"{row.mode}:{row.scenario.key}" for row in self.rows if row.retried],
            "non_timing_failures": [f"{row.mode}:{row.scenario.key}" for row in self.rows if row.non_timing],
            **self.info,
            "scenarios": [row.as_dict() for row in self.rows],
            "negative_control": None
            if self.control is None
            else {**self.control.as_dict(), "failed_as_it_must": self.control_failed},
            "output_control": None if self.output_control is None else self.output_control.as_dict(),
            "simulator": [{**asdict(c), "ok": c.ok} for c in self.comparisons],
            "skipped": self.skipped,
        }


def p_says(ev: Evidence) -> str:
    """P's evidence in a few words."""
    if not ev.pinned:
        return "nothing pinned"
    freed = "held" if ev.freed_after is None else f"freed {ev.freed_after:.1f}s"
    return f"{freed}, expired +{ev.expired}, unrecognized +{ev.after_expiry}"


def table(report: Report) -> str:
    """The printed table: one line per scenario, then the control and the simulator."""
    head = f"{'mode':7} {'scenario':30} {'status':>6}  {'P (own evidence)':38} {'sidecar':9} {'D read':6}"
    lines = [head + "  verdict"]
    rows = [*report.rows, *([report.control] if report.control else [])]
    for row in rows:
        ev = row.evidence
        verdict = "pass" if row.passed else "FAIL: " + "; ".join(map(str, row.problems))
        if row.retried:
            verdict = (
                f"RETRIED {verdict} (attempt {len(row.attempts) + 1}: "
                + "; ".join(
                    f"{'+'.join(attempt.kinds)} in a {attempt.window_stall:.1f} s stall"
                    for attempt in row.attempts
                )
                + ")"
            )
        if row is report.control:
            verdict = (
                "control ok (fails as it must): " if report.control_failed else "CONTROL PASSED: "
            ) + verdict
        lines.append(
            f"{row.mode:7} {row.scenario.key:30} {ev.status:>6}  {p_says(ev):38} "
            f"{'sent ' + str(ev.sidecar_sent):9} {ev.d_reads:>6}  {verdict}"
        )
    if report.output_control is not None:
        lines.append(summary(report.output_control))
    for c in report.comparisons:
        state = "same" if not c.differences else ("known: " + c.known if c.known else "DIFFERENT")
        found = ": " + "; ".join(c.differences) if c.differences else ""
        lines.append(f"sim     {c.key:30} {c.sim.status:>6}  {state}{found}")
    lines += [f"skipped: {reason}" for reason in report.skipped]
    retried = [row for row in report.rows if row.retried]
    lines.append(
        f"retried: {len(retried)} of {len(report.rows)} rows, each after a timing failure in a stall"
    )
    lines.append(f"result: {report.result}" + (f" ({report.error})" if report.error else ""))
    return "\n".join(lines)
