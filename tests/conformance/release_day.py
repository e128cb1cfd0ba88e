"""Release day: whether a vLLM release changes anything the sidecar depends on, in minutes.

``make vllm-release VLLM=X.Y.Z`` (``python -m tests.conformance.release_day --vllm
X.Y.Z``; without a version, the newest final release on the package index)
downloads X.Y.Z's wheel and the wheel of the release to hold it against into
the cache of ``tests.conformance.wheels``, reads both with
``tests.conformance.vllm_facts`` (``zipfile`` + ``ast``, never imported) and
prints one row per fact: its value in the release held against, in X.Y.Z, and
``same`` or ``DIFFERENT``; then it runs the conformance suite on X.Y.Z's wheel
alone (every module's release variable, ``SUITE``, set to it). Exit status: 0
when nothing the sidecar depends on differs and the suite passes, 1 when
something differs or the suite fails, 2 when the lane could not run (no wheel,
no index, not a version).

What X.Y.Z is held against: a release the sidecar does not know (no
``sidecar.nixl.versions.WireProfile``: newer than NEWEST, say) against NEWEST's
wheel, the newest behaviour the sidecar's tables describe. A release it knows
against its own wheel: its differences from NEWEST are already in those
tables, which the suite checks, so once a release is made known the lane
answers 0 for it when the suite passes. To P of a release it does not know
the NIXL tests speak NEWEST's wire format (``KVR_CONFORMANCE_WIRE_AS``): the
question of the day is whether that format still works.

Rows that are shown but never fail the lane (``INFORMATIONAL``): the NIXL
connector's version, and the full field list of ``NixlAgentMetadata``. The
version only feeds ``compatibility_hash``, which D compares with its own; the
sidecar, P's peer in D's place, neither computes nor checks it
(``sidecar.nixl.messages.HandshakePayloadView`` decodes it and nothing reads
it; ``sidecar.nixl.handshake`` sends only the rank request) and P's listener
answers any request. Of ``NixlAgentMetadata`` the releaser decodes
``engine_id`` and ``agent_metadata`` (a msgpack map, unknown keys ignored):
those two and the class's kind count; the other fields are what the
simulators and tests encode to play P (``tests.support.nixl_layouts.AGENT_METADATA_LAYOUTS``), to extend
when the release is made known (docs/testing.md, "When vLLM releases").
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import pytest

from sidecar.nixl import versions
from sidecar.nixl.versions import WireProfile, parse_version
from tests.conformance.vllm_facts import ABSENT, SEP, Facts, wheel_facts
from tests.conformance.vllm_source import WIRE_AS
from tests.conformance.wheels import WHEEL_PLATFORM, cached, fetch_wheel, pip_command, wheel_dir

ROOT = Path(__file__).resolve().parents[2]
#: Each conformance module that reads vLLM wheels, and the variable naming the releases it reads.
SUITE = {
    "tests/conformance/test_vllm_coverage_source.py": "KVR_CONFORMANCE_COVERAGE_VLLM",
    "tests/conformance/test_vllm_decode_state_source.py": "KVR_CONFORMANCE_DECODE_STATE_VLLM",
    "tests/conformance/test_vllm_duplicates.py": "KVR_CONFORMANCE_DUPLICATE_VLLM",
    "tests/conformance/test_vllm_forged_params.py": "KVR_CONFORMANCE_FORGED_VLLM",
    "tests/conformance/test_vllm_p_side.py": "KVR_CONFORMANCE_VLLM",
    "tests/conformance/test_vllm_parallel_sampling.py": "KVR_CONFORMANCE_SAMPLING_VLLM",
    "tests/conformance/test_vllm_plugin_contract.py": "KVR_CONFORMANCE_PLUGIN_VLLM",
    "tests/conformance/test_vllm_release_day.py": "KVR_CONFORMANCE_RELEASE_DAY_VLLM",
}
#: Shown, never failing the lane (the module docstring says why).
INFORMATIONAL = frozenset({"nixl: NIXL_CONNECTOR_VERSION", "nixl: NixlAgentMetadata fields"})
Verdict = Literal["same", "DIFFERENT", "changed, not depended on"]
WIDTH = 36  # of a value column; longer values are cut in the table and given whole below it


class LaneError(Exception):
    """The lane could not run: no wheel, no package index, not a version."""


@dataclass(frozen=True, slots=True)
class Row:
    name: str
    known: str
    new: str
    verdict: Verdict


def dotted(version: tuple[int, int, int]) -> str:
    return ".".join(map(str, version))


def held_against(version: str) -> str:
    """The release whose wheel ``version`` is compared with: itself when known, else NEWEST."""
    return version if WireProfile.for_version(version) is not None else dotted(versions.NEWEST)


def compare(known: Facts, new: Facts) -> list[Row]:
    """One row per fact of either side, in name order; a fact one side lacks is ``absent`` there."""
    rows = []
    for name in sorted(known.keys() | new.keys()):
        before, after = known.get(name, ABSENT), new.get(name, ABSENT)
        verdict: Verdict = "same"
        if before != after:
            verdict = "changed, not depended on" if name in INFORMATIONAL else "DIFFERENT"
        rows.append(Row(name, before, after, verdict))
    return rows


def exit_code(rows: Sequence[Row], suite_passed: bool) -> int:
    """0 when no depended-on fact differs and the suite passed, else 1."""
    return 0 if suite_passed and all(row.verdict != "DIFFERENT" for row in rows) else 1


def _cut(text: str) -> str:
    return text if len(text) <= WIDTH else text[: WIDTH - 3] + "..."


def render(rows: Sequence[Row], known_label: str, new_label: str) -> str:
    """The table, then every changed row whole (for lists, what was added and removed)."""
    width = max(len(row.name) for row in rows)
    lines = [f"{'fact':<{width}}  {known_label:<{WIDTH}}  {new_label:<{WIDTH}}  verdict"]
    lines.append("-" * len(lines[0]))
    lines += [
        f"{r.name:<{width}}  {_cut(r.known):<{WIDTH}}  {_cut(r.new):<{WIDTH}}  {r.verdict}" for r in rows
    ]
    for row in (r for r in rows if r.verdict != "same"):
        lines += ["", f"{row.verdict}: {row.name}", *_change(row, known_label, new_label)]
    return "\n".join(lines)


def _change(row: Row, known_label: str, new_label: str) -> list[str]:
    before, after = row.known.split(SEP), row.new.split(SEP)
    if ABSENT not in (row.known, row.new) and (len(before) > 1 or len(after) > 1):
        return [f"  - {item}" for item in before if item not in after] + [
            f"  + {item}" for item in after if item not in before
        ]
    return [f"  {known_label}: {row.known}", f"  {new_label}: {row.new}"]


# --- what the lane does outside: the index, the wheels, the suite ---------------------------


def newest_final(listing: str) -> str:
    """The newest final release in ``pip index versions``' output (pre-releases excluded)."""
    match = re.search(r"^Available versions:\s*(.+)$", listing, re.MULTILINE)
    if match is None:
        raise LaneError(f"no 'Available versions:' line in pip's answer: {listing.strip()[:300]!r}")
    finals = []
    for text in (v.strip() for v in match[1].split(",")):
        parsed = parse_version(text)
        if parsed is not None and not parsed.pre:
            finals.append((parsed.release, text))
    if not finals:
        raise LaneError("the package index lists no final vLLM release")
    return max(finals, key=lambda item: item[0])[1]  # pip lists newest first: max keeps the first tie


def newest_on_index() -> str:
    """The newest final vLLM release the index holds today: ``pip index versions``, else the name of
    the wheel ``pip download`` picks (kept in the cache)."""
    done = subprocess.run(
        [*pip_command(), "index", "versions", "vllm"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    if done.returncode == 0:
        return newest_final(done.stdout)
    directory = wheel_dir()
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=directory, prefix=".download-") as staging:
        command = [*pip_command(), "download", "--no-deps", *WHEEL_PLATFORM, "vllm", "-d", staging]
        fetched = subprocess.run(command, capture_output=True, text=True, timeout=900, check=False)
        found = sorted(Path(staging).glob("vllm-*.whl"))
        if fetched.returncode != 0 or not found:
            raise LaneError(f"no package index answered: {(done.stderr + fetched.stderr).strip()[-500:]}")
        version = found[0].name.split("-")[1]
        if cached(version) is None:
            found[0].replace(directory / found[0].name)
        return version


def fetch(version: str) -> Path:
    """``version``'s wheel from the cache, downloaded if needed; ``LaneError`` when it cannot be."""
    try:
        return fetch_wheel(version)
    except pytest.skip.Exception as exc:
        raise LaneError(str(exc)) from None
    except RuntimeError as exc:
        raise LaneError(str(exc)) from None


def suite_environment(version: str, environ: dict[str, str]) -> dict[str, str]:
    """``environ`` with every suite module reading ``version`` only, and NEWEST's wire format spoken
    to it when the sidecar does not know it."""
    env = dict(environ, **dict.fromkeys(SUITE.values(), version))
    if WireProfile.for_version(version) is None:
        env[WIRE_AS] = dotted(versions.NEWEST)
    return env


def run_suite(version: str) -> int:
    """The conformance suite on ``version``'s wheel; pytest's exit status."""
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:randomly", "-p", "no:cacheprovider", *SUITE]
    print(f"\n$ {' '.join(command[1:])}  (every module on vLLM {version})", flush=True)
    return subprocess.run(
        command, cwd=ROOT, env=suite_environment(version, dict(os.environ)), check=False
    ).returncode


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.conformance.release_day", description=__doc__)
    parser.add_argument("--vllm", default="", help="the release to check (default: the index's newest final)")
    parser.add_argument("--no-suite", action="store_true", help="print the table only")
    args = parser.parse_args(argv)
    try:
        version = args.vllm or newest_on_index()
        if parse_version(version) is None:
            raise LaneError(f"{version!r} is not a vLLM version (like 0.34.0)")
        against = held_against(version)
        print(f"vLLM {version} held against {against}", end="")
        print(
            " (its own wheel: a release the sidecar knows)" if against == version else " (NEWEST)", flush=True
        )
        new_wheel, known_wheel = fetch(version), fetch(against)
    except LaneError as exc:
        print(f"release_day: {exc}", file=sys.stderr)
        return 2
    rows = compare(wheel_facts(known_wheel), wheel_facts(new_wheel))
    print(render(rows, against, version))
    passed = args.no_suite or run_suite(version) == 0
    code = exit_code(rows, passed)
    differing = [row.name for row in rows if row.verdict == "DIFFERENT"]
    print(f"\nvLLM {version}: {len(differing)} depended-on fact(s) differ from {against}", end="")
    print("; conformance suite " + ("not run" if args.no_suite else "passed" if passed else "FAILED"), end="")
    print(f"; exit {code}")
    return code


if __name__ == "__main__":
    sys.exit(main())
