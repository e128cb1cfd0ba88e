"""Under CI a conformance test that could not read vLLM's code fails, unless that is allowed.

The hook is checked on reports directly, and once end to end: one conformance test
in a child pytest under ``CI=true`` with no cached wheel and no package index (a
closed port), as a CI without network would run it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conformance import conftest

ROOT = Path(__file__).resolve().parents[2]
ONE = "tests/conformance/test_vllm_plugin_contract.py::test_notify_kv_transfer_request_rejected[0.33.0]"
SKIPPED = ("wheels.py", 55, "Skipped: vLLM wheels not cached in /x and no package index reachable")


def judged(item: pytest.Item, outcome: str) -> pytest.TestReport:
    """The report ``outcome`` becomes once the conformance hook has seen it."""
    longrepr = SKIPPED if outcome == "skipped" else None
    report = pytest.TestReport(item.nodeid, item.location, {}, outcome, longrepr, "setup")  # type: ignore[arg-type]
    hook = conftest.pytest_runtest_makereport(item, None)  # type: ignore[arg-type]
    next(hook)
    with pytest.raises(StopIteration) as done:
        hook.send(report)
    result = done.value.value
    assert isinstance(result, pytest.TestReport)
    return result


@pytest.mark.parametrize(
    ("env", "outcome"),
    [({}, "skipped"), ({"CI": "true"}, "failed"), ({"CI": "true", conftest.ALLOW: "1"}, "skipped")],
    ids=["local", "ci", "ci-allowed"],
)
def test_a_skip_fails_under_ci_unless_allowed(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, env: dict[str, str], outcome: str
) -> None:
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.delenv(conftest.ALLOW, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    report = judged(request.node, "skipped")
    assert report.outcome == outcome
    if outcome == "failed":
        assert report.longrepr == (
            "a conformance test skipped under CI (vLLM wheels not cached in /x and no package index"
            f" reachable); {conftest.ALLOW}=1 allows it"
        )
    assert judged(request.node, "passed").outcome == "passed"


def test_a_ci_run_without_wheels_or_index_fails(tmp_path: Path) -> None:
    environ = {k: v for k, v in os.environ.items() if k != conftest.ALLOW}
    environ |= {
        "CI": "true",
        "KVR_VLLM_WHEEL_DIR": str(tmp_path),
        "PIP_INDEX_URL": "http://127.0.0.1:9/simple",
    }
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", ONE]
    done = subprocess.run(command, cwd=ROOT, env=environ, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stdout[-2000:]
    assert done.stdout.splitlines()[-1].startswith("1 error in")
    assert "a conformance test skipped under CI (vLLM wheels not cached" in done.stdout
