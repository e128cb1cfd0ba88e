"""The e2e verdicts and report: a scenario passes only on P's evidence, and the control must fail."""

from __future__ import annotations

import json

import pytest

from tests.e2e.__main__ import worth_another
from tests.e2e.evidence import Evidence, PLog
from tests.e2e.report import Report, Row, table
from tests.e2e.scenarios import CONTROL, SIDECAR_SCENARIOS, Expect
from tests.e2e.simcompare import Answer, Comparison, differences
from tests.e2e.verdict import judge, only_late

LEASE = 20.0


def freed_by_sidecar(**changes: object) -> Evidence:
    """What P showed when the sidecar freed a rejected request at once (the nixl mode's evidence)."""
    base = Evidence(status=400, pinned=True, freed_after=0.3, sidecar={"sent": 1}, lease=LEASE)
    for name, value in changes.items():
        setattr(base, name, value)
    return base


def released_by_nobody() -> Evidence:
    """A sidecar with releases off, on a rejection before D's handler: P's lease frees the block."""
    return Evidence(
        status=400,
        pinned=True,
        freed_after=LEASE + 0.1,
        expired=1,
        p_log=PLog(expired=("cmpl-1-0-aa",)),
        sidecar={"off": 1},
        lease=LEASE,
    )


def test_a_release_by_the_sidecar_passes() -> None:
    assert judge(Expect.SIDECAR_FREES, 400, freed_by_sidecar()) == []


def test_releases_off_fails_the_before_handler_scenario_on_p_expiry() -> None:
    problems = judge(CONTROL.expectation("off"), CONTROL.expected_status(), released_by_nobody())
    assert any(p.startswith("P's lease freed it: expired +1") for p in problems)
    assert any("only after" in p for p in problems)
    assert "the sidecar sent 0 releases, not 1 ({'off': 1})" in problems


@pytest.mark.parametrize(
    ("changes", "problem"),
    [
        ({"after_expiry": 1}, "a duplicate"),
        ({"p_log": PLog(unrecognized=("cmpl-1",))}, "a duplicate"),
        ({"expired": 1}, "P's lease freed it"),
        ({"p_log": PLog(expired=("cmpl-1",))}, "P's lease freed it"),
        ({"freed_after": None}, "P still held its blocks"),
        ({"freed_after": LEASE}, "only after"),
        ({"sidecar": {"sent": 2}}, "the sidecar sent 2 releases"),
        ({"d_reads": 1}, "D read P's blocks"),
        ({"pinned": False}, "tested nothing"),
        ({"status": 200}, "the client got 200, not 400"),
        ({"failed_notifications": 1}, "P counted failures"),
    ],
)
def test_any_other_evidence_fails_it(changes: dict[str, object], problem: str) -> None:
    problems = judge(Expect.SIDECAR_FREES, 400, freed_by_sidecar(**changes))
    assert any(problem in p for p in problems), problems


def test_d_own_fix_passes_only_without_a_release_from_the_sidecar() -> None:
    by_d = freed_by_sidecar(sidecar={"covered_by_engine": 1})
    assert judge(Expect.D_FREES, 400, by_d) == []
    assert judge(Expect.D_FREES, 400, freed_by_sidecar()) == [
        "the sidecar sent 1 releases, not 0 ({'sent': 1})"
    ]


def test_an_admitted_request_needs_a_read_and_the_same_answer_as_d_alone() -> None:
    read = Evidence(
        status=200,
        pinned=True,
        freed_after=0.8,
        d_reads=1,
        same_output=True,
        output="a",
        reference="a",
        lease=LEASE,
    )
    assert judge(Expect.D_READS, 200, read) == []
    read.same_output, read.reference = False, "b"
    assert judge(Expect.D_READS, 200, read) == ["the P/D answer 'a' differs from D's own 'b'"]
    read.same_output, read.d_reads = None, 0
    assert judge(Expect.D_READS, 200, read) == [
        "D made no NIXL read",
        "the answer was not compared with D's own",
    ]


def test_a_lease_expectation_needs_the_expiry_and_no_release() -> None:
    assert judge(Expect.LEASE, 400, released_by_nobody()) == []
    assert judge(Expect.LEASE, 400, freed_by_sidecar()) != []


def test_nothing_pinned_expectation() -> None:
    assert judge(Expect.NOT_PINNED, 413, Evidence(status=413)) == []
    assert judge(Expect.NOT_PINNED, 413, Evidence(status=413, pinned=True)) == [
        "P served a prefill leg for it"
    ]


def row(evidence: Evidence, problems: list[str] | None = None) -> Row:
    scenario = SIDECAR_SCENARIOS[0]
    return Row("nixl", scenario, evidence, problems if problems is not None else [])


def test_the_run_passes_only_with_a_failing_control_and_known_differences() -> None:
    report = Report(rows=[row(freed_by_sidecar())])
    control = released_by_nobody()
    report.control = Row("off", CONTROL, control, judge(Expect.SIDECAR_FREES, 400, control))
    assert report.result == "pass"
    report.control = Row("off", CONTROL, freed_by_sidecar(), [])  # the control passed: the harness is blind
    assert report.result == "fail"
    report.control = Row("off", CONTROL, control, judge(Expect.SIDECAR_FREES, 400, control))
    same = Answer(400, "Bad Request", "body.max_tokens", None, False)
    other = Answer(400, "Bad Request", "body.max_tokens", None, True)
    report.comparisons = [Comparison("k", same, other, differences(same, other))]
    assert report.result == "fail"
    report.comparisons[0].known = "explained"
    assert report.result == "pass"


def test_a_run_that_stopped_early_is_an_error_not_a_pass() -> None:
    assert Report().result == "error"
    assert Report(rows=[row(freed_by_sidecar())], error="EngineFailed: P exited").result == "error"


def test_the_report_and_table_carry_p_evidence_per_scenario() -> None:
    evidence = freed_by_sidecar(p_log=PLog(("x",), (), ("line",)))
    report = Report(rows=[row(evidence, ["bad"])], skipped=["http: no token"])
    data = json.loads(json.dumps(report.as_dict(), default=str))
    scenario = data["scenarios"][0]
    assert scenario["passed"] is False and scenario["problems"] == ["bad"]
    assert scenario["evidence"]["p_log"] == {"expired": ["x"], "unrecognized": []}
    assert scenario["evidence"]["p_log_lines"] == ["line"]
    printed = table(report)
    assert "freed 0.3s, expired +0, unrecognized +0" in printed
    assert "FAIL: bad" in printed and "skipped: http: no token" in printed
    assert printed.endswith("result: fail")


def test_differences_name_each_field() -> None:
    real = Answer(400, "BadRequestError", "temperature", None, True)
    sim = Answer(200, None, None, None, True)
    assert differences(real, sim) == [
        "status: vLLM 400, simulator 200",
        "error_type: vLLM 'BadRequestError', simulator None",
        "error_param: vLLM 'temperature', simulator None",
    ]
    unknown = Answer(400, "BadRequestError", "temperature", None, None)  # P's evidence could not tell
    assert differences(unknown, Answer(400, "BadRequestError", "temperature", None, True)) == []


def test_only_lateness_earns_a_second_attempt() -> None:
    late = freed_by_sidecar(expired=1, after_expiry=1, freed_after=LEASE + 0.5, p_log=PLog(("r",), ("r",)))
    assert judge(Expect.SIDECAR_FREES, 400, late) != []
    assert only_late(Expect.SIDECAR_FREES, 400, late)
    # Not lateness: nobody's notification arrived, or two did, or the wrong party sent it.
    assert not only_late(Expect.SIDECAR_FREES, 400, released_by_nobody())
    assert not only_late(Expect.SIDECAR_FREES, 400, freed_by_sidecar(expired=1, after_expiry=2))
    assert not only_late(Expect.D_FREES, 400, late)
    assert not only_late(Expect.SIDECAR_FREES, 400, freed_by_sidecar(after_expiry=1))  # a duplicate
    assert not only_late(Expect.LEASE, 400, late)


def test_another_attempt_after_a_stall_or_once_after_lateness() -> None:
    late = freed_by_sidecar(expired=1, after_expiry=1, freed_after=LEASE + 0.5)
    assert worth_another(Expect.SIDECAR_FREES, 400, late, [])
    assert not worth_another(Expect.SIDECAR_FREES, 400, late, ["attempt 1 failed"])
    stalled = released_by_nobody()
    stalled.stall = 12.0
    assert worth_another(Expect.SIDECAR_FREES, 400, stalled, ["attempt 1 failed"])
    assert not worth_another(Expect.SIDECAR_FREES, 400, released_by_nobody(), [])  # a real failure
