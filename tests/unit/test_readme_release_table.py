"""README.md's release table, row by row, against the judge under the shipped defaults.

The table ("What is released, and what is not") is read from README.md. Each
row's first cell names a scenario; ``SCENARIOS`` turns it into what the judge
is given (the ``Event``, the route, D's vLLM release) and the test asserts
that the judge's decision frees P's blocks the way the row's "freed by" cell
says: a job sent by the sidecar, a job D's own release covers (recorded,
never sent), or nothing, which leaves the blocks to D's read (2xx) or to P's
lease. The judge runs with ``Config()`` as ``serve`` ships it and a strategy
that sends releases (``nixl``, ``http`` and ``auto`` all free and check); the
README says that the default ``dry-run`` sends nothing.

A row added to the table without a scenario here, or a scenario whose row
was reworded, fails ``test_every_row_has_a_scenario``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import pytest
from prometheus_client import CollectorRegistry

from sidecar.classify import (
    ADMISSION_OVERFLOW_MESSAGES,
    ADMISSION_OVERFLOW_TYPE,
    Cause,
    Event,
    FirstEvent,
    NoAnswer,
    stream_event,
)
from sidecar.config import Config
from sidecar.decision.judge import InFlight, Judge
from sidecar.decision.policy import SIDECAR
from sidecar.observability.metrics import Metrics
from sidecar.observability.tracing import Tracing
from sidecar.params import check
from sidecar.proxy.context import Exchange
from sidecar.release.auto import AutoReleaser
from sidecar.release.base import ReleaseJob
from sidecar.release.http import HttpReleaser
from sidecar.upstream.client import Sent
from tests.support.fakes import FakeDecode, release_params
from tests.unit.rigs import V033

README = Path(__file__).resolve().parents[2] / "README.md"
HEADER = "| what happened | released by the sidecar? | freed by |"
SIDECAR_FREES, D_FREES, LEASE_FREES = "the sidecar", "D itself", "P's lease"
CHAT, COMPLETIONS, RESPONSES, GENERATE = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/responses",
    "/inference/v1/generate",
)
OVERFLOW = next(iter(sorted(ADMISSION_OVERFLOW_MESSAGES)))


@dataclass(frozen=True)
class Case:
    """One judge input: what happened, on which route, with D on which vLLM release."""

    event: Event
    route: str = COMPLETIONS
    version: str | None = "0.33.0"
    sent: bool = True  # the request reached D's socket
    eligible: bool = True  # the request carried releasable parameters
    settings: dict[str, Any] = field(default_factory=dict)


def stream_error(code: int, kind: str, message: str | None = None) -> Event:
    return stream_event(FirstEvent(code, kind, message))


# The first cell of each row, and the judge inputs it stands for (every one must free as the row says).
SCENARIOS: dict[str, list[Case]] = {
    "D's handler refused it on chat, completions or responses: 400 `BadRequestError`, 404 "
    "`NotFoundError` (unknown model), 422 `UnprocessableEntityError` (0.25.0+)": [
        Case(Event(status=400, error_type="BadRequestError"), CHAT, "0.21.0"),
        Case(Event(status=404, error_type="NotFoundError"), COMPLETIONS, "0.33.0"),
        Case(Event(status=422, error_type="UnprocessableEntityError"), RESPONSES, "0.25.1"),
    ],
    "the same answers from a D before vLLM 0.21.0": [
        Case(Event(status=400, error_type="BadRequestError"), CHAT, "0.20.0"),
        Case(Event(status=404, error_type="NotFoundError"), COMPLETIONS, "0.13.0"),
    ],
    "D refused it before its handler: body validation (400 `Bad Request`), auth (401), a user "
    "middleware; or any refusal on `/inference/v1/generate`": [
        Case(Event(status=400, error_type="Bad Request"), CHAT),
        Case(Event(status=401), COMPLETIONS),
        Case(Event(status=400, error_type="BadRequestError"), GENERATE),
    ],
    "D answered 500 `InternalServerError` (a dead engine, or an error inside the handler)": [
        Case(Event(status=500, error_type="InternalServerError"), CHAT, "0.33.0"),
        Case(Event(status=500, error_type="InternalServerError"), CHAT, "0.20.0"),
    ],
    "D answered a status in `--retried-statuses` (default 502, 503, 504), e.g. a 503 while draining": [
        Case(Event(status=503)),
        Case(Event(status=503, error_type="ServiceUnavailableError"), GENERATE),
    ],
    "D unreachable (refused, DNS, connect or pool timeout): the sidecar answers 503": [
        Case(Event(failure=failure), sent=False)
        for failure in (
            NoAnswer.CONNECT_REFUSED,
            NoAnswer.DNS,
            NoAnswer.CONNECT_TIMEOUT,
            NoAnswer.POOL_TIMEOUT,
        )
    ],
    "the sidecar shutting down, or over `--limit-concurrency`: it answers 503": [
        Case(Event(failure=NoAnswer.SHUTTING_DOWN), sent=False),
        Case(Event(failure=NoAnswer.OVERLOADED), sent=False),
    ],
    "body over `--max-body-bytes`: the sidecar answers 413": [
        Case(Event(failure=NoAnswer.BODY_TOO_LARGE), sent=False),
    ],
    "`stream: true`, 200, first SSE event an error with a 4xx code": [
        Case(stream_error(400, "BadRequestError"), CHAT),
        Case(stream_error(400, "BadRequestError"), COMPLETIONS, "0.20.0"),
    ],
    "`stream: true`, 200, first SSE event vLLM's queue-limit 503 (0.29.0+)": [
        Case(stream_error(503, ADMISSION_OVERFLOW_TYPE, OVERFLOW), CHAT, "0.29.0"),
    ],
    "D answered 2xx": [
        Case(Event(status=200)),
        Case(stream_event(FirstEvent(None, None)), CHAT),
    ],
    "no headers from D in `--header-timeout` (the sidecar answers 504), a reset after sending (502)": [
        Case(Event(failure=NoAnswer.HEADER_TIMEOUT), CHAT),
        Case(Event(failure=NoAnswer.RESET_AFTER_SEND), COMPLETIONS),
    ],
    "a 5xx error event in a stream, the client gone after forwarding": [
        Case(stream_error(500, "InternalServerError"), CHAT),
        Case(Event(failure=NoAnswer.CLIENT_GONE_AFTER_FORWARD), COMPLETIONS),
    ],
    "push mode, empty `remote_block_ids`, malformed parameters": [
        Case(Event(status=400, error_type="Bad Request"), eligible=False),
    ],
}


def release_table() -> dict[str, tuple[str, str]]:
    """The README table: first cell -> (the "released by the sidecar?" cell, the "freed by" cell)."""
    text = README.read_text(encoding="utf-8")
    assert HEADER in text, f"README.md lost its release table (header {HEADER!r})"
    lines = text.split(HEADER, 1)[1].splitlines()[2:]  # skip the header's own rest and |---|
    rows: dict[str, tuple[str, str]] = {}
    for line in lines:
        if not line.startswith("|"):
            break
        cells = [cell.strip() for cell in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
        assert len(cells) == 3, f"a release table row without three cells: {line}"
        rows[cells[0]] = (cells[1], cells[2])
    return rows


def freed_by(cell: str) -> str:
    """The party a "freed by" cell names first (what follows in parentheses is commentary)."""
    for party in (SIDECAR_FREES, D_FREES, LEASE_FREES):
        if cell.startswith(party):
            return party
    raise AssertionError(
        f"'freed by' must start with {SIDECAR_FREES!r}, {D_FREES!r} or {LEASE_FREES!r}: {cell!r}"
    )


class Queue:
    """The pipeline's seam, holding the strategy as the judge sees it: one that frees and checks."""

    def __init__(self) -> None:
        self.releaser = Live()
        self.jobs: list[ReleaseJob] = []

    def submit(self, job: ReleaseJob) -> bool:
        self.jobs.append(job)
        return True


class Live:
    frees = True
    checked = True


def judged(case: Case) -> str:
    """Who frees P's blocks after the judge's decision on ``case`` (default config unless it says)."""
    config = Config(**case.settings)
    queue = Queue()
    metrics = Metrics(CollectorRegistry())
    judge = Judge(config, queue, metrics, InFlight(100, 30), FakeDecode(case.version), Tracing())  # type: ignore[arg-type]
    params = release_params(V033) if case.eligible else None
    exchange = Exchange(
        request_id="req-1",
        route=case.route,
        params=params,
        stream=case.event.stream,
        started=0.0,
        policy=SIDECAR,
    )
    exchange.sent = Sent() if case.sent else None
    decision = judge.judge(exchange, case.event)
    assert decision is not None
    if queue.jobs:
        (job,) = queue.jobs
        return D_FREES if job.covered else SIDECAR_FREES
    return D_FREES if decision.cause is Cause.ADMITTED else LEASE_FREES


def test_the_strategies_the_table_describes_free_and_check() -> None:
    assert (HttpReleaser.frees, HttpReleaser.checked) == (Live.frees, Live.checked)
    assert (AutoReleaser.frees, AutoReleaser.checked) == (Live.frees, Live.checked)


def test_every_row_has_a_scenario() -> None:
    rows = release_table()
    assert set(rows) == set(SCENARIOS), (
        f"rows without a scenario: {sorted(set(rows) - set(SCENARIOS))}; "
        f"scenarios without a row: {sorted(set(SCENARIOS) - set(rows))}"
    )


@pytest.mark.parametrize("row", list(SCENARIOS), ids=lambda row: row[:48])
def test_each_row_frees_as_the_judge_decides(row: str) -> None:
    _, cell = release_table()[row]
    expected = freed_by(cell)
    for case in SCENARIOS[row]:
        assert judged(case) == expected, (row, case)


def test_ineligible_parameters_reach_the_judge_without_parameters() -> None:
    """The last row's inputs: the request path finds no releasable parameters in them."""
    for fields in (
        {**V033, "transfer_mode": "push"},
        {**V033, "remote_block_ids": []},
        {**V033, "remote_port": "not a port"},
    ):
        assert check(msgspec.json.encode(fields)).params is None, fields


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        # Retried statuses: nothing in front retries, so D unreachable and the sidecar's 503s release.
        (
            Case(
                Event(failure=NoAnswer.CONNECT_REFUSED), sent=False, settings={"retried_statuses": ("none",)}
            ),
            SIDECAR_FREES,
        ),
        (
            Case(Event(failure=NoAnswer.SHUTTING_DOWN), sent=False, settings={"retried_statuses": ("none",)}),
            SIDECAR_FREES,
        ),
        (Case(Event(status=503), settings={"retried_statuses": ("none",)}), SIDECAR_FREES),
        # --release-ambiguous alone: a header timeout (504) and a reset (502) are retried statuses.
        (
            Case(Event(failure=NoAnswer.HEADER_TIMEOUT), CHAT, settings={"release_ambiguous": True}),
            LEASE_FREES,
        ),
        (Case(Event(failure=NoAnswer.RESET_AFTER_SEND), settings={"release_ambiguous": True}), LEASE_FREES),
        # ... with nothing retried: released; a header timeout on a wrapped route is D's (0.21.0+).
        (
            Case(
                Event(failure=NoAnswer.RESET_AFTER_SEND),
                settings={"release_ambiguous": True, "retried_statuses": ("none",)},
            ),
            SIDECAR_FREES,
        ),
        (
            Case(
                Event(failure=NoAnswer.HEADER_TIMEOUT),
                CHAT,
                settings={"release_ambiguous": True, "retried_statuses": ("none",)},
            ),
            D_FREES,
        ),
        # A stream's 5xx event and a client gone after forwarding: released with --release-ambiguous.
        (
            Case(stream_error(500, "InternalServerError"), CHAT, settings={"release_ambiguous": True}),
            SIDECAR_FREES,
        ),
        (
            Case(
                Event(failure=NoAnswer.CLIENT_GONE_AFTER_FORWARD),
                GENERATE,
                settings={"release_ambiguous": True},
            ),
            SIDECAR_FREES,
        ),
        # ... D's own release covers a client gone on its wrapped routes (0.21.0+).
        (
            Case(
                Event(failure=NoAnswer.CLIENT_GONE_AFTER_FORWARD), CHAT, settings={"release_ambiguous": True}
            ),
            D_FREES,
        ),
        (
            Case(
                Event(failure=NoAnswer.CLIENT_GONE_AFTER_FORWARD),
                CHAT,
                "0.20.0",
                settings={"release_ambiguous": True},
            ),
            SIDECAR_FREES,
        ),
    ],
    ids=[
        "unreachable-none",
        "shutting-down-none",
        "503-none",
        "header-timeout-ambiguous-alone",
        "reset-ambiguous-alone",
        "reset-ambiguous-none",
        "header-timeout-ambiguous-none",
        "stream-5xx-ambiguous",
        "client-gone-ambiguous",
        "client-gone-ambiguous-wrapped-route",
        "client-gone-ambiguous-before-0.21",
    ],
)
def test_what_the_released_column_says_of_other_settings(case: Case, expected: str) -> None:
    assert judged(case) == expected
