"""The e2e verdicts and report: a scenario passes only on P's evidence, and the control must fail."""

from __future__ import annotations

import json

import pytest

from tests.e2e.__main__ import run_row
from tests.e2e.controls import Leg, OutputControl
from tests.e2e.evidence import Evidence, PLog
from tests.e2e.report import Attempt, Report, Row, table
from tests.e2e.scenarios import CONTROL, SIDECAR_SCENARIOS, Expect, scenarios_for
from tests.e2e.simcompare import Answer, Comparison, differences
from tests.e2e.verdict import ATTEMPTS, TIMING, Kind, Problem, judge, kinds_of, retry_allowed

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


def texts(problems: list[Problem]) -> list[str]:
    return [str(problem) for problem in problems]


def test_releases_off_fails_the_before_handler_scenario_on_p_expiry() -> None:
    problems = judge(CONTROL.expectation("off"), CONTROL.expected_status(), released_by_nobody())
    assert any(p.startswith("P's lease freed it: expired +1") for p in texts(problems))
    assert any("only after" in p for p in texts(problems))
    assert "the sidecar sent 0 releases, not 1 ({'off': 1})" in texts(problems)
    # Expired and late, but also a release missing: never worth another attempt, stall or not.
    assert kinds_of(problems) == [Kind.EXPIRED, Kind.LATE, Kind.RELEASES]
    assert not retry_allowed(kinds_of(problems), 30.0, 1)


@pytest.mark.parametrize(
    ("changes", "problem", "kinds"),
    [
        ({"after_expiry": 1}, "a duplicate", [Kind.DUPLICATE]),
        ({"p_log": PLog(unrecognized=("cmpl-1",))}, "a duplicate", [Kind.DUPLICATE]),
        ({"expired": 1}, "P's lease freed it", [Kind.EXPIRED]),
        ({"p_log": PLog(expired=("cmpl-1",))}, "P's lease freed it", [Kind.EXPIRED]),
        ({"freed_after": None}, "P still held its blocks", [Kind.LATE]),
        ({"freed_after": LEASE}, "only after", [Kind.LATE]),
        ({"sidecar": {"sent": 2}}, "the sidecar sent 2 releases", [Kind.RELEASES]),
        ({"sidecar": {"sent": 1, "failed": 1}}, "the sidecar sent 1 releases", [Kind.RELEASES]),
        ({"sidecar": {"failed": 1}}, "the sidecar sent 0 releases", [Kind.RELEASES]),
        ({"sidecar": {"refused": 1}}, "the sidecar sent 0 releases", [Kind.RELEASES]),
        ({"d_reads": 1}, "D read P's blocks", [Kind.READ]),
        ({"pinned": False}, "tested nothing", [Kind.UNPINNED]),
        ({"status": 200}, "the client got 200, not 400", [Kind.STATUS]),
        ({"failed_notifications": 1}, "P counted failures", [Kind.P_FAILURE]),
        # Expired, then two notifications: one late, one a duplicate.
        ({"expired": 1, "after_expiry": 2}, "a duplicate", [Kind.EXPIRED, Kind.DUPLICATE]),
    ],
)
def test_any_other_evidence_fails_it(changes: dict[str, object], problem: str, kinds: list[Kind]) -> None:
    problems = judge(Expect.SIDECAR_FREES, 400, freed_by_sidecar(**changes))
    assert any(problem in p for p in texts(problems)), problems
    assert kinds_of(problems) == kinds


def test_d_own_fix_passes_only_without_a_release_from_the_sidecar() -> None:
    by_d = freed_by_sidecar(sidecar={"covered_by_engine": 1})
    assert judge(Expect.D_FREES, 400, by_d) == []
    assert texts(judge(Expect.D_FREES, 400, freed_by_sidecar())) == [
        "the sidecar sent 1 releases, not 0 ({'sent': 1})"
    ]
    # A release the sidecar tried and failed (or was refused) is an attempt it must not make.
    assert kinds_of(judge(Expect.D_FREES, 400, freed_by_sidecar(sidecar={"failed": 1}))) == [Kind.RELEASES]


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
    assert texts(judge(Expect.D_READS, 200, read)) == [
        "the P/D answer differs from D's own: 'a' vs D's own 'b'"
    ]
    read.output_differences = ["logprobs differ by up to 0.3000 (tolerance 0.02)"]
    assert texts(judge(Expect.D_READS, 200, read)) == [
        "the P/D answer differs from D's own: logprobs differ by up to 0.3000 (tolerance 0.02)"
    ]
    read.same_output, read.d_reads = None, 0
    assert texts(judge(Expect.D_READS, 200, read)) == [
        "D made no NIXL read",
        "the answer was not compared with D's own",
    ]


def test_a_lease_expectation_needs_the_expiry_and_no_release() -> None:
    assert judge(Expect.LEASE, 400, released_by_nobody()) == []
    assert judge(Expect.LEASE, 400, freed_by_sidecar()) != []


def test_nothing_pinned_expectation() -> None:
    assert judge(Expect.NOT_PINNED, 413, Evidence(status=413)) == []
    assert texts(judge(Expect.NOT_PINNED, 413, Evidence(status=413, pinned=True))) == [
        "P served a prefill leg for it"
    ]


def row(
    evidence: Evidence, problems: list[Problem] | None = None, attempts: list[Attempt] | None = None
) -> Row:
    scenario = SIDECAR_SCENARIOS[0]
    return Row("nixl", scenario, evidence, problems if problems is not None else [], attempts or [])


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
    report = Report(rows=[row(evidence, [Problem(Kind.STATUS, "bad")])], skipped=["http: no token"])
    data = json.loads(json.dumps(report.as_dict(), default=str))
    scenario = data["scenarios"][0]
    assert scenario["passed"] is False and scenario["problems"] == ["bad"] and scenario["kinds"] == ["status"]
    assert scenario["retried"] is False and scenario["failed_attempts"] == []
    assert data["non_timing_failures"] == ["nixl:admit"] and data["retried_rows"] == []
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


def late() -> Evidence:
    """The sidecar's release reached P after P's lease had freed the blocks."""
    return freed_by_sidecar(expired=1, after_expiry=1, freed_after=LEASE + 0.5, p_log=PLog(("r",), ("r",)))


def test_lateness_is_a_timing_fault_a_duplicate_is_not() -> None:
    assert kinds_of(judge(Expect.SIDECAR_FREES, 400, late())) == [Kind.EXPIRED, Kind.LATE]
    # The same late notification, but the wrong party sent it, or nobody at all: not only time.
    assert Kind.RELEASES in kinds_of(judge(Expect.D_FREES, 400, late()))
    assert Kind.RELEASES in kinds_of(judge(Expect.SIDECAR_FREES, 400, released_by_nobody()))
    # A notification for blocks P no longer held, with no expiry: a second notification.
    assert kinds_of(judge(Expect.SIDECAR_FREES, 400, freed_by_sidecar(after_expiry=1))) == [Kind.DUPLICATE]
    # D read blocks P had already freed by expiry (and reused): the answer differs, never retried.
    read_late = Evidence(
        status=200,
        pinned=True,
        freed_after=LEASE + 1,
        expired=1,
        after_expiry=1,
        d_reads=1,
        same_output=False,
        output="a",
        reference="b",
        lease=LEASE,
    )
    assert kinds_of(judge(Expect.D_READS, 200, read_late)) == [Kind.EXPIRED, Kind.LATE, Kind.OUTPUT]


@pytest.mark.parametrize(
    ("kinds", "window_stall", "attempts", "allowed"),
    [
        ([], 30.0, 1, False),  # it passed
        ([Kind.EXPIRED], 2.0, 1, True),
        ([Kind.EXPIRED, Kind.LATE], 12.0, 2, True),
        ([Kind.LATE], 2.5, 1, True),
        ([Kind.LATE], 1.9, 1, False),  # no stall in its release window: a real failure
        ([Kind.EXPIRED], 0.0, 1, False),
        ([Kind.EXPIRED], 12.0, ATTEMPTS, False),  # the last attempt
        ([Kind.UNSENT], 12.0, 1, True),  # the harness starved between its connect and its write
        ([Kind.UNSENT], 0.5, 1, False),  # no stall: something closed it, look at it
        *(([Kind.EXPIRED, kind], 30.0, 1, False) for kind in Kind if kind not in TIMING),
        *(([kind], 30.0, 1, False) for kind in Kind if kind not in TIMING),
    ],
)
def test_retry_only_a_timing_failure_in_a_stall(
    kinds: list[Kind], window_stall: float, attempts: int, allowed: bool
) -> None:
    assert retry_allowed(kinds, window_stall, attempts) is allowed


def test_a_request_the_sidecar_never_read_is_the_harness_s_and_only_that() -> None:
    # Seen on real engines with the machine starved: P pinned, the harness's request to the sidecar
    # failed with no answer, the sidecar counted no request, and P's lease freed the blocks.
    unsent = released_by_nobody()
    unsent.status, unsent.sidecar = 0, {}
    unsent.transport_error = "RemoteProtocolError: Server disconnected without sending a response."
    problems = judge(Expect.SIDECAR_FREES, 400, unsent)
    assert kinds_of(problems) == [Kind.UNSENT]
    assert texts(problems) == [
        "the request never reached the sidecar (RemoteProtocolError: Server disconnected without "
        "sending a response.)"
    ]
    # The sidecar read it (it counted a request) and the client still got no answer: the sidecar's
    # fault, never run again, and every other check still applies.
    unsent.sidecar_requests = 1
    problems = judge(Expect.SIDECAR_FREES, 400, unsent)
    assert kinds_of(problems)[0] is Kind.STATUS
    assert texts(problems)[0].startswith("the sidecar read the request and gave no answer (")
    assert Kind.RELEASES in kinds_of(problems)
    assert not retry_allowed(kinds_of(problems), 30.0, 1)


def test_a_retried_row_is_marked_and_a_non_timing_attempt_fails_the_run() -> None:
    attempt = Attempt.of(judge(Expect.SIDECAR_FREES, 400, late()), late())
    assert attempt.timing_only and attempt.kinds == (Kind.EXPIRED, Kind.LATE)
    control = released_by_nobody()
    report = Report(rows=[row(freed_by_sidecar(), [], [attempt])])
    report.control = Row("off", CONTROL, control, judge(Expect.SIDECAR_FREES, 400, control))
    assert report.result == "pass"
    data = json.loads(json.dumps(report.as_dict(), default=str))
    assert data["retried_rows"] == ["nixl:admit"] and data["non_timing_failures"] == []
    assert data["scenarios"][0]["retried"] is True
    assert data["scenarios"][0]["failed_attempts"][0]["kinds"] == ["expired", "late"]
    printed = table(report)
    assert "RETRIED pass (attempt 2: expired+late in a 0.0 s stall)" in printed
    assert "retried: 1 of 1 rows" in printed
    # An earlier attempt that failed for another reason (a duplicate) fails the run, even if the
    # last attempt passed: the harness never reruns one, and the report would not hide it.
    duplicate = freed_by_sidecar(after_expiry=1)
    report.rows = [
        row(freed_by_sidecar(), [], [Attempt.of(judge(Expect.SIDECAR_FREES, 400, duplicate), duplicate)])
    ]
    assert report.rows[0].non_timing and report.result == "fail"


def test_a_first_look_after_the_lease_cannot_time_the_free_p_counters_decide() -> None:
    # The decode leg took longer than P's lease (a loaded D): the harness first looked at P after
    # it. No expiry and no late notification: D's notification freed the blocks in time.
    slow = freed_by_sidecar(freed_after=LEASE + 4, first_poll=LEASE + 3.9)
    assert judge(Expect.SIDECAR_FREES, 400, slow) == []
    assert kinds_of(judge(Expect.SIDECAR_FREES, 400, freed_by_sidecar(freed_after=LEASE + 4))) == [Kind.LATE]
    expired = freed_by_sidecar(freed_after=LEASE + 4, first_poll=LEASE + 3.9, expired=1)
    assert kinds_of(judge(Expect.SIDECAR_FREES, 400, expired)) == [Kind.EXPIRED]


def test_left_for_a_retry_needs_the_expiry_no_attempt_and_the_sidecar_s_word() -> None:
    left = released_by_nobody()
    left.sidecar, left.not_released, left.status = {}, {"retryable": 1}, 503
    assert judge(Expect.LEFT, 503, left) == []
    left.sidecar = {"failed": 1}  # it tried: not left for the retry
    assert kinds_of(judge(Expect.LEFT, 503, left)) == [Kind.RELEASES]
    left.sidecar, left.not_released = {}, {}
    assert kinds_of(judge(Expect.LEFT, 503, left)) == [Kind.RELEASES]
    # Nobody can release (http, D down): one failed attempt at the deadline is expected.
    tried = released_by_nobody()
    tried.sidecar = {"failed": 1}
    assert judge(Expect.LEASE, 400, tried) == []
    tried.sidecar = {"failed": 1, "sent": 1}
    assert kinds_of(judge(Expect.LEASE, 400, tried)) == [Kind.RELEASES]


def crossed(same: list[bool | None], reads: int = 2, status: int = 200) -> OutputControl:
    """The output control's evidence: two crossed legs, each compared with D's own answer."""
    legs = [
        Leg(name, blocks, Evidence(status=status, same_output=value))
        for (name, blocks), value in zip((("A", "B"), ("B", "A")), same, strict=True)
    ]
    return OutputControl(legs, Evidence(d_reads=reads, freed_after=2.0), tokens=160)


@pytest.mark.parametrize(
    ("control", "detected"),
    [
        (crossed([False, False]), True),
        (crossed([True, False]), False),  # one crossed leg matched D alone: the check is blind to it
        (crossed([None, False]), False),  # not compared
        (crossed([False, False], reads=1), False),  # D computed one itself: not a wrong read
        (crossed([False, False], status=400), False),
        (OutputControl(error="no prompt of 160 tokens"), False),
    ],
)
def test_the_output_control_is_detected_only_when_every_crossed_leg_differs(
    control: OutputControl, detected: bool
) -> None:
    assert control.detected is detected


def test_the_run_fails_when_the_output_check_cannot_see_wrong_blocks() -> None:
    control = released_by_nobody()
    report = Report(rows=[row(freed_by_sidecar())])
    report.control = Row("off", CONTROL, control, judge(Expect.SIDECAR_FREES, 400, control))
    report.output_control = crossed([False, False])
    assert report.result == "pass"
    assert "output control: D read another request's blocks: detected" in table(report)
    report.output_control = crossed([True, True])
    assert report.result == "fail"
    assert "NOT DETECTED" in table(report)
    assert report.as_dict()["output_control"]["detected_as_it_must"] is False


class Scripted:
    """Stands in for ``tests.e2e.runner.Runner``: each ``run`` returns the next evidence."""

    def __init__(self, *evidence: Evidence) -> None:
        self.evidence = list(evidence)
        self.runs = 0

    def run(self, scenario: object, mode: object, sidecar: object) -> Evidence:
        self.runs += 1
        return self.evidence.pop(0)


def stalled(ev: Evidence, seconds: float = 12.0) -> Evidence:
    ev.window_stall = seconds
    return ev


@pytest.mark.parametrize(
    ("script", "runs", "passed", "retried"),
    [
        ([freed_by_sidecar()], 1, True, False),
        ([stalled(late()), freed_by_sidecar()], 2, True, True),  # late in a stall, then on time
        ([late(), freed_by_sidecar()], 1, False, False),  # late without a stall: reported
        ([stalled(late()), stalled(late()), stalled(late())], 3, False, True),  # three attempts at most
        # Never run again, however long the stall: a duplicate, a failed release, a wrong status.
        ([stalled(freed_by_sidecar(after_expiry=1)), freed_by_sidecar()], 1, False, False),
        ([stalled(freed_by_sidecar(sidecar={"failed": 1})), freed_by_sidecar()], 1, False, False),
        ([stalled(freed_by_sidecar(status=503)), freed_by_sidecar()], 1, False, False),
        # Late in a stall, then a duplicate: the second attempt's non-timing failure stands.
        ([stalled(late()), stalled(freed_by_sidecar(after_expiry=2)), freed_by_sidecar()], 2, False, True),
    ],
)
def test_the_harness_runs_a_scenario_again_only_as_the_rule_says(
    script: list[Evidence], runs: int, passed: bool, retried: bool
) -> None:
    runner = Scripted(*script)
    pre = next(s for s in SIDECAR_SCENARIOS if s.key == "pre-validation")
    result = run_row(runner, "nixl", pre, None)  # type: ignore[arg-type]
    assert (runner.runs, result.passed, result.retried) == (runs, passed, retried)
    assert all(attempt.timing_only for attempt in result.attempts)
    report = Report(rows=[result])
    report.control = Row(
        "off", CONTROL, released_by_nobody(), judge(Expect.SIDECAR_FREES, 400, released_by_nobody())
    )
    assert report.result == ("pass" if passed else "fail")


def test_both_pods_down_behind_nginx_may_end_in_its_own_502_and_nowhere_else() -> None:
    """nginx's "no live upstreams" 502 is accepted only where a front stands before both pods."""
    down = next(scenario for scenario in SIDECAR_SCENARIOS if scenario.d_down and not scenario.stream)
    assert down.also_accepted("pods") == frozenset({502})
    assert down.also_accepted("defaults") == frozenset()
    left = released_by_nobody()
    left.sidecar, left.not_released, left.status = {}, {"retryable": 1}, 502
    assert judge(Expect.LEFT, 503, left, down.also_accepted("pods")) == []
    assert kinds_of(judge(Expect.LEFT, 503, left, down.also_accepted("defaults"))) == [Kind.STATUS]
    left.status = 500
    assert kinds_of(judge(Expect.LEFT, 503, left, down.also_accepted("pods"))) == [Kind.STATUS]


def test_a_retried_pair_is_judged_by_every_prefill_p_ran() -> None:
    """smg's retries: P ran the five prefills smg asks for, the sidecar released all five; four
    releases, or a sixth prefill, fail; without the sidecar all five must expire."""
    five = freed_by_sidecar(status=500, sidecar={"sent": 5}, prefills=5)
    assert judge(Expect.SIDECAR_FREES, 500, five, prefills=5) == []
    assert texts(
        judge(
            Expect.SIDECAR_FREES,
            500,
            freed_by_sidecar(status=500, sidecar={"sent": 4}, prefills=5),
            prefills=5,
        )
    ) == ["the sidecar sent 4 releases, not 5 ({'sent': 4})"]
    six = judge(
        Expect.SIDECAR_FREES, 500, freed_by_sidecar(status=500, sidecar={"sent": 5}, prefills=6), prefills=5
    )
    assert kinds_of(six) == [Kind.PREFILLS]
    held = Evidence(
        status=500,
        pinned=True,
        freed_after=LEASE + 0.1,
        expired=5,
        p_log=PLog(expired=tuple(f"cmpl-{n}" for n in range(5))),
        prefills=5,
        lease=LEASE,
    )
    assert judge(Expect.LEASE, 500, held, prefills=5) == []
    one = Evidence(**{**held.__dict__, "expired": 1, "p_log": PLog(expired=("cmpl-0",))})
    assert kinds_of(judge(Expect.LEASE, 500, one, prefills=5)) == [Kind.NO_EXPIRY]


def test_the_smg_modes_scenarios() -> None:
    """smg in front: admitted requests and the keyless refusal; its control holds the refusal's five
    prefills to P's lease."""
    smg = {s.key: s for s in scenarios_for("smg")}
    assert {"admit", "admit-chat", "admit-stream", "pre-no-key", "pre-no-key-stream"} == set(smg)
    no_key = smg["pre-no-key"]
    assert (no_key.keyless, no_key.prefills, no_key.expected_status()) == (True, 5, 500)
    assert no_key.expectation("smg") is Expect.SIDECAR_FREES
    [control] = scenarios_for("smg-bare")
    assert control is no_key and control.expectation("smg-bare") is Expect.LEASE
    assert smg["pre-no-key-stream"].prefills == 1 and smg["pre-no-key-stream"].expected_status() == 401
