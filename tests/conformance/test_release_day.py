"""The release-day lane (``make vllm-release``): its readings, its comparison, its exit status.

The readings are checked on the cached 0.33.0 wheel (``fetch_wheel``, as the
other conformance tests); the comparison on hand-made fact records; ``main``
end to end on two small wheels cut from 0.33.0's (the files the facts are read
from), one of them with a refusal added, so no second release is downloaded.
"""

from __future__ import annotations

import re
import subprocess
import tomllib
import zipfile
from pathlib import Path

import pytest

from sidecar.classify import ADMISSION_OVERFLOW_MESSAGES
from sidecar.decision.coverage import WRAPPED_ROUTES
from sidecar.nixl import versions
from tests.conformance import release_day
from tests.conformance.release_day import (
    INFORMATIONAL,
    SUITE,
    LaneError,
    Row,
    compare,
    exit_code,
    held_against,
    newest_final,
    render,
    suite_environment,
)
from tests.conformance.vllm_facts import PREFIXES, SEP, wheel_facts
from tests.conformance.vllm_source import WIRE_AS, spoken
from tests.conformance.wheels import fetch_wheel

ROOT = Path(__file__).resolve().parents[2]
KNOWN = "0.33.0"


@pytest.fixture(scope="module")
def facts() -> dict[str, str]:
    return wheel_facts(fetch_wheel(KNOWN))


# --- the readings, on a real wheel ----------------------------------------------------------


def test_every_fact_of_the_newest_known_release_is_read(facts: dict[str, str]) -> None:
    assert not [name for name, value in facts.items() if "unreadable" in value]
    assert facts["nixl: NIXL_CONNECTOR_VERSION"] == "15"
    assert facts["nixl: GET_META_MSG"] == "b'get_meta_msg'"
    assert (
        facts["nixl: NixlAgentMetadata fields the releaser reads"] == "engine_id: str; agent_metadata: bytes"
    )
    assert (
        facts["nixl: NixlHandshakePayload fields"] == "compatibility_hash: str; agent_metadata_bytes: bytes"
    )
    assert facts["nixl: side-channel request"].startswith("[msg, target_pp_rank, target_tp_rank] =")
    assert facts["nixl: side-channel reply frames"].split(SEP)[1] == "ts"  # payload, P's perf_counter
    assert "rsplit(':', 1)" in facts["notify: parse of '<id>:<n>'"]
    unknown = facts["notify: P's answer to an id it does not hold"].split(SEP)
    assert (
        unknown[-1] == "continue" and "logger.error()" in unknown and not any("raise" in s for s in unknown)
    )
    assert facts["notify: kv_lease_duration default"] == "30"


def test_the_serving_facts_match_what_the_sidecar_knows(facts: dict[str, str]) -> None:
    assert facts["errors: admission check raises"] == "MaxQueuedTokensError; QueueOverflowError"
    overflow = facts["errors: exception QueueOverflowError"].split(SEP)
    assert overflow[:2] == ["GracefulHTTPError", "503"] and eval(overflow[2]) in ADMISSION_OVERFLOW_MESSAGES
    assert facts["errors: create_error_response(VLLMNotFoundError)"] == "'NotFoundError' 404"
    assert set(facts["fix: wrapped routes"].split(SEP)) == WRAPPED_ROUTES
    assert facts["errors: /v1/messages awaits the wrapped chat handler"] == "True"
    assert "503: 'overloaded_error'" in facts["errors: /v1/messages Anthropic type by status"]
    assert facts["errors: literal answers in /inference/v1/generate"] == "400 BadRequestError"
    assert "abort_immediately=True: True" in facts["fix: AsyncLLM.notify_kv_transfer_request_rejected"]
    assert facts["abort: EngineCore.add_request"] == "if request.abort_immediately: self.abort_requests()"
    assert facts["abort: AsyncLLM.generate aborts when cancelled"] == "True"
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]
    assert eval(facts["plugin: ENDPOINT_PLUGINS_GROUP"]) in declared  # the group the plugin registers in


# --- the comparison, on hand-made records ---------------------------------------------------


def test_compare_marks_each_fact() -> None:
    known = {"a": "1", "b": "x; y", "nixl: NIXL_CONNECTOR_VERSION": "15", "gone": "v"}
    new = {"a": "1", "b": "x; y; z", "nixl: NIXL_CONNECTOR_VERSION": "16", "added": "w"}
    rows = {row.name: row for row in compare(known, new)}
    assert [row.name for row in compare(known, new)] == sorted(rows)
    assert rows["a"].verdict == "same"
    assert rows["b"].verdict == "DIFFERENT"
    assert rows["nixl: NIXL_CONNECTOR_VERSION"].verdict == "changed, not depended on"
    assert (rows["gone"].new, rows["gone"].verdict) == ("absent", "DIFFERENT")
    assert (rows["added"].known, rows["added"].verdict) == ("absent", "DIFFERENT")


@pytest.mark.parametrize(
    ("verdicts", "suite_passed", "code"),
    [
        (["same", "same"], True, 0),
        (["same", "changed, not depended on"], True, 0),  # the connector version alone
        (["same", "DIFFERENT"], True, 1),
        (["same", "same"], False, 1),  # the suite failed on the new wheel
        ([], True, 0),
    ],
)
def test_exit_code(verdicts: list[release_day.Verdict], suite_passed: bool, code: int) -> None:
    rows = [Row(f"f{i}", "1", "2", verdict) for i, verdict in enumerate(verdicts)]
    assert exit_code(rows, suite_passed) == code


def test_only_the_connector_version_and_the_full_field_list_are_informational() -> None:
    assert {"nixl: NIXL_CONNECTOR_VERSION", "nixl: NixlAgentMetadata fields"} == INFORMATIONAL


def test_render_gives_each_changed_fact_whole() -> None:
    rows = compare(
        {"fields": "a: int; b: dict[str, int]", "long": "x" * 100, "same": "1"},
        {"fields": "a: int; c: str", "long": "y" * 100, "same": "1"},
    )
    text = render(rows, "0.33.0", "0.34.0")
    header, rule, *table = text.splitlines()
    assert header.split() == ["fact", "0.33.0", "0.34.0", "verdict"] and set(rule) == {"-"}
    assert [line.split()[-1] for line in table[:3]] == ["DIFFERENT", "DIFFERENT", "same"]
    assert "  - b: dict[str, int]" in table and "  + c: str" in table
    assert f"  0.34.0: {'y' * 100}" in table  # cut in the table, whole below it
    assert not [line for line in table[:3] if "x" * 100 in line]


def test_a_known_release_is_held_against_itself_an_unknown_one_against_newest(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    newest = ".".join(map(str, versions.NEWEST))
    assert held_against(newest) == newest
    assert held_against("0.29.0") == "0.29.0"
    assert held_against("99.0.0") == newest
    # Once a release is made known (NEWEST moves to it), it is held against its own wheel.
    monkeypatch.setattr(versions, "NEWEST", (99, 0, 0))
    monkeypatch.setattr(versions, "RELEASES", (*versions.RELEASES, (99, 0, 0)))
    assert held_against("99.0.0") == "99.0.0"
    assert held_against("99.1.0") == "99.0.0"


def test_newest_final_skips_pre_releases() -> None:
    listing = (
        "vllm (0.35.0rc1)\nAvailable versions: 0.35.0rc1, 0.35.0.dev3, 0.34.0, 0.33.0, 0.10.1.1, 0.10.1\n"
    )
    assert newest_final(listing) == "0.34.0"
    assert newest_final("Available versions: 0.10.1.1, 0.10.1, 0.9.2") == "0.10.1.1"
    with pytest.raises(LaneError):
        newest_final("ERROR: No matching distribution found for vllm")
    with pytest.raises(LaneError):
        newest_final("Available versions: 1.0.0rc1")


def test_the_suite_reads_only_the_new_release() -> None:
    env = suite_environment("99.0.0", {"PATH": "/bin", "KVR_CONFORMANCE_VLLM": "0.11.0"})
    assert {env[variable] for variable in SUITE.values()} == {"99.0.0"} and env["PATH"] == "/bin"
    assert env[WIRE_AS] == ".".join(map(str, versions.NEWEST))  # speak NEWEST's format to it
    assert WIRE_AS not in suite_environment("0.33.0", {})


def test_the_nixl_tests_speak_a_known_format_to_an_unknown_release_only_when_told(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(WIRE_AS, raising=False)
    assert (spoken("99.0.0"), spoken("0.21.0")) == ("99.0.0", "0.21.0")  # unknown: the tests fail on it
    monkeypatch.setenv(WIRE_AS, "0.33.0")
    assert (spoken("99.0.0"), spoken("0.21.0")) == ("0.33.0", "0.21.0")  # a known one keeps its own


def test_every_conformance_module_that_reads_wheels_is_in_the_suite_with_its_variable() -> None:
    modules = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests/conformance").glob("test_vllm_*.py"))
    assert sorted(SUITE) == modules
    for module, variable in SUITE.items():
        # The variable is read by the module or by a helper of the suite it imports.
        text = (ROOT / module).read_text()
        helpers = re.findall(r"^from tests\.conformance\.(\w+) import", text, re.MULTILINE)
        read = [text] + [(ROOT / "tests/conformance" / f"{name}.py").read_text() for name in helpers]
        assert any(f'"{variable}"' in part for part in read), module


def test_make_target_passes_vllm_through() -> None:
    def dry_run(*args: str) -> str:
        done = subprocess.run(["make", "-n", "vllm-release", *args], cwd=ROOT, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        return next(line.strip() for line in done.stdout.splitlines() if "release_day" in line)

    assert re.search(r"-m tests\.conformance\.release_day --vllm 0\.34\.0$", dry_run("VLLM=0.34.0"))
    assert dry_run().endswith("-m tests.conformance.release_day")  # no version: the index's newest


# --- main, end to end on small wheels -------------------------------------------------------


def cut_wheel(files: dict[str, str], directory: Path, version: str, extra: str = "") -> None:
    """A wheel of ``version`` holding ``files`` (plus ``extra`` at the end of ``vllm/exceptions.py``)."""
    with zipfile.ZipFile(directory / f"vllm-{version}-py3-none-any.whl", "w") as cut:
        for name, text in files.items():
            cut.writestr(name, text + extra if name == "vllm/exceptions.py" else text)


def test_main_fails_on_a_new_refusal_and_passes_a_known_release(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    with zipfile.ZipFile(fetch_wheel(KNOWN)) as whole:  # the files the facts are read from
        files = {
            name: whole.read(name).decode()
            for name in whole.namelist()
            if name.endswith(".py") and name.startswith(PREFIXES)
        }
    refusal = (
        "\n\nclass EngineBurntError(GracefulHTTPError):\n    def __init__(self):\n"
        '        super().__init__("Burnt.", HTTPStatus.SERVICE_UNAVAILABLE)\n'
    )
    cut_wheel(files, tmp_path, KNOWN)
    cut_wheel(files, tmp_path, "99.0.0", refusal)
    monkeypatch.setenv("KVR_VLLM_WHEEL_DIR", str(tmp_path))
    monkeypatch.setattr(versions, "NEWEST", (0, 33, 0))

    assert release_day.main(["--vllm", "99.0.0", "--no-suite"]) == 1
    out = capsys.readouterr().out
    assert "vLLM 99.0.0 held against 0.33.0" in out
    assert "DIFFERENT: errors: exception EngineBurntError" in out and "'Burnt.'" in out
    assert release_day.main(["--vllm", KNOWN, "--no-suite"]) == 0  # a known release: against itself
    out = capsys.readouterr().out
    assert f"vLLM {KNOWN} held against {KNOWN} (its own wheel" in out
    assert f"0 depended-on fact(s) differ from {KNOWN}" in out
    assert release_day.main(["--vllm", "latest"]) == 2  # not a version
    assert "not a vLLM version" in capsys.readouterr().err
