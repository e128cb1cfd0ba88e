"""D's ``GET /version`` answering no version: warned from the first probe at start, in the log,
and shown as ``kvr_vllm_version_unusable{reason}``, as a newer-than-known version is shown."""

from __future__ import annotations

import logging

import pytest
from prometheus_client import CollectorRegistry

from sidecar.decode.notice import VersionNotice
from sidecar.decode.probes import VersionRead, read_version
from sidecar.observability.metrics import Metrics
from tests.support.fakes import ProbedD, connect_refused, probed_state


@pytest.mark.parametrize(
    ("answer", "read"),
    [
        ((200, [], b'{"version":"0.34.0"}'), VersionRead(True, "0.34.0")),
        ((404, [], b'{"detail":"Not Found"}'), VersionRead(True, None, "status", "answered 404")),
        (
            (200, [], b"garbage"),
            VersionRead(True, None, "not_json", "answered b'garbage', not a JSON object"),
        ),
        ((200, [], b""), VersionRead(True, None, "not_json", "answered an empty body, not a JSON object")),
        ((200, [], b"[1]"), VersionRead(True, None, "not_json", "answered b'[1]', not a JSON object")),
        (
            (200, [], b'{"v": 1}'),
            VersionRead(True, None, "no_version", "answered JSON without a version string"),
        ),
        (
            (200, [], b'{"version":"garbage"}'),
            VersionRead(True, "garbage", "not_a_version", "named 'garbage', not a version"),
        ),
        (connect_refused(), VersionRead(False)),
    ],
    ids=["version", "404", "not-json", "empty", "array", "no-version", "not-a-version", "unreachable"],
)
async def test_each_answer_is_a_version_or_says_why_not(answer: object, read: VersionRead) -> None:
    assert await read_version(ProbedD(version=answer)) == read  # type: ignore[arg-type]


def notice(configured: str = "") -> tuple[VersionNotice, Metrics]:
    metrics = Metrics(CollectorRegistry())
    return VersionNotice("newest", metrics.unknown_vllm, metrics.version_unusable, configured), metrics


def unusable(metrics: Metrics, reason: str) -> float | None:
    return metrics.registry.get_sample_value("kvr_vllm_version_unusable", {"reason": reason})


def test_an_unusable_answer_is_warned_once_and_shown_until_d_names_a_version(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="sidecar.version")
    said, metrics = notice()
    garbage = VersionRead(True, None, "not_json", "answered b'garbage', not a JSON object")
    said.read(garbage)
    said.read(garbage)
    [warning] = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert warning.getMessage().startswith("D's GET /version answered b'garbage', not a JSON object: ")
    assert "refuses every release (unknown_version)" in warning.getMessage()
    assert unusable(metrics, "not_json") == 1
    said.read(VersionRead(False))  # D unreachable says nothing of its version
    assert unusable(metrics, "not_json") == 1
    said.read(VersionRead(True, None, "status", "answered 404"))  # another reason: said again
    assert (unusable(metrics, "not_json"), unusable(metrics, "status")) == (0, 1)
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 2
    said.read(VersionRead(True, "0.34.0"))
    assert unusable(metrics, "status") == 0
    assert caplog.records[-1].getMessage() == "D's GET /version names vLLM 0.34.0 again"


def test_with_vllm_version_set_the_warning_says_that_version_is_used(
    caplog: pytest.LogCaptureFixture,
) -> None:
    said, metrics = notice(configured="0.34.0")
    said.read(VersionRead(True, "garbage", "not_a_version", "named 'garbage', not a version"))
    assert "releases use vllm_version 0.34.0" in caplog.text and unusable(metrics, "not_a_version") == 1


async def test_the_first_probe_at_start_warns(caplog: pytest.LogCaptureFixture) -> None:
    said, metrics = notice()
    state = probed_state(ProbedD(version=(200, [], b"")), on_version=said.read)
    await state.start()
    try:
        assert "D's GET /version answered an empty body" in caplog.text
        assert unusable(metrics, "not_json") == 1 and state.view().version is None
    finally:
        await state.close()
