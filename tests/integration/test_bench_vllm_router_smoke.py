"""``python -m bench --workload streams --quick --modes router`` with vllm-router beside router mode.

The smoke run of ``make bench``'s comparison: vLLM's own P/D router
(``.tools/vllm-router``, installed by ``make test`` and ``make bench``) and the
sidecar in router mode, each pinned to the hop's CPU and each free on both
(the sidecar with two workers, vllm-router with its default threads), a few
dozen clients through the fake P and D. It checks that every path completed
streams without an error, that the fake P got exactly one prefill leg per
stream from each hop (and what vllm-router adds to it), and that the
side-by-side table and its verdicts were printed for both pairs. Speed is not
asserted: which hop is ahead is the full benchmark's finding.
"""

from __future__ import annotations

import shutil
from typing import Any

import pytest

from bench.streams.vllm_router import INSTALLED
from tests.integration.bench_runs import run_bench

HOPS = ["sidecar", "sidecar-w2", "vllm-router", "vllm-router-w2"]

# serial: the bench loads the machine (make test runs it alone)
pytestmark = [pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler"), pytest.mark.serial]


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    if not INSTALLED.exists():
        pytest.fail(f"{INSTALLED} is missing: make test creates it")
    out = tmp_path_factory.mktemp("vllm-router") / "streams.json"
    args = ("--workload", "streams", "--quick", "--modes", "router", "--workers", "1,2")
    data, stdout = run_bench(out, *args, "--paths", ",".join(HOPS), timeout=90)
    data["stdout"] = stdout
    return data


def test_every_path_completed_streams_and_p_got_one_prefill_leg_per_stream(report: dict[str, Any]) -> None:
    [run] = report["runs"]
    assert run["mode"] == "router" and run["order"] == ["direct", *HOPS]
    events = report["settings"]["events"] + 1  # and [DONE]
    for path, entry in run["paths"].items():
        sample, got = entry["sample"], entry["prefill"]
        assert sample["errors"] == 0, (path, sample["first_errors"])
        streams = sample["events_total"] / events  # every stream of the phase, ramp and drain included
        # Streams completed over the whole phase: the 1 s sample window alone can hold none on a
        # loaded machine when a hop's first streams wait, which is speed, not what this run checks.
        assert streams >= 1, path
        # a leg per stream; one the client had not finished reading when the phase ended may count
        assert streams <= got["legs"] <= streams + report["settings"]["clients"], path
        assert got["refused"] == 0 and got["other"] == 0  # round_robin: no /render requests
        assert got["with_min_tokens"] == (got["legs"] if path.startswith("vllm-router") else 0)
        if path != "direct":
            assert entry["load"]["hop_us_per_stream"] > 0


def test_the_table_prints_both_routers_side_by_side_with_a_verdict_per_pair(report: dict[str, Any]) -> None:
    [run] = report["runs"]
    assert [(v["ours"], v["theirs"]) for v in run["versus"]] == [
        ("sidecar", "vllm-router"),
        ("sidecar-w2", "vllm-router-w2"),
    ]
    seconds = report["settings"]["seconds"]
    for judged in run["versus"]:
        assert judged["rate"] == run["paths"][judged["ours"]]["sample"]["streams"] / seconds
        assert judged["their_ttft_p99_ms"] == run["paths"][judged["theirs"]]["sample"]["ttft_p99_ms"]
    out = report["stdout"]
    assert "router mode beside vllm-router" in out
    for path in ["direct", *HOPS]:
        assert any(line.split()[:1] == [path] for line in out.splitlines()), path
    for how in ("one core each: sidecar ", "every core: sidecar-w2 "):
        [line] = [line for line in out.splitlines() if line.strip().startswith(how)]
        assert line.endswith(("  PASS", "  MISS"))
    assert "vllm-router sends P:" in out
