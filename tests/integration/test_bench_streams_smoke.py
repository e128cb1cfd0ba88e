"""``python -m bench --workload streams --quick`` runs end to end and its figures are sane.

The smoke run builds the C load generator and fake D, starts the fake P, both
sidecars, the relays (and nginx when the machine has it), and runs every path
of both modes with a few dozen clients, the sidecar and nginx each also with two
processes. It checks that every stream was
answered whole (the bench counts anything else as an error), that each
figure is consistent with the others and with the run's shape, and that the
derived ones (added over direct, targets) follow from the measured ones.
Speed is not asserted: the targets are the full benchmark's business.
"""

from __future__ import annotations

import shutil
from typing import Any

import pytest

from tests.integration.bench_runs import run_bench

NGINX = shutil.which("nginx") is not None
# The workers axis (--workers 1,2): the sidecar with two workers, and nginx with two processes.
PATHS = ["direct", "sidecar", "sidecar-w2", "relay"] + (["nginx", "nginx-w2"] if NGINX else [])

# serial: the bench loads the machine (make test runs it alone)
pytestmark = [pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler"), pytest.mark.serial]


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("streams") / "streams.json"
    data, stdout = run_bench(out, "--workload", "streams", "--quick", "--workers", "1,2")
    data["stdout"] = stdout
    return data


def test_every_path_of_both_modes_ran_without_an_error(report: dict[str, Any]) -> None:
    assert [(run["round"], run["mode"]) for run in report["runs"]] == [(1, "sidecar"), (1, "router")]
    for run in report["runs"]:
        assert sorted(run["paths"]) == sorted(PATHS)
        assert run["order"] == PATHS  # round 1: the base order
        for path, entry in run["paths"].items():
            for phase in (entry["sample"], entry["recovery"]):
                assert phase["errors"] == 0, (run["mode"], path, phase["first_errors"])
                assert phase["statuses"] == {}
            # the short phase right after may see none start in its window on a stalled machine
            assert entry["sample"]["streams"] > 0
            burst = entry["burst"]
            if run["mode"] == "router":
                assert burst is None  # the accept-burst step runs in sidecar mode
                continue
            # every new connection was accepted and ran its one stream whole
            assert burst["streams"] == burst["clients"] == report["settings"]["burst"]
            assert burst["errors"] == 0 and burst["statuses"] == {}
            assert 0 < burst["ttft_p50_ms"] <= burst["ttft_p99_ms"] <= burst["ttft_max_ms"]
    assert ("nginx: no nginx binary" in " ".join(report["skipped"])) is not NGINX


def test_the_figures_fit_the_runs_shape(report: dict[str, Any]) -> None:
    settings = report["settings"]
    interval_ms = 1000 * settings["duration"] / (settings["events"] - 1)
    for run in report["runs"]:
        for path, entry in run["paths"].items():
            sample, load = entry["sample"], entry["load"]
            ttft = [sample[f"ttft_{q}_ms"] for q in ("p50", "p90", "p99", "max")]
            assert 0 <= ttft[0] <= ttft[1] <= ttft[2] <= ttft[3]
            # D paces every stream: its events are spread out (a stalled hop may bunch some up)
            assert 0 <= sample["gap_p50_ms"] <= sample["gap_p99_ms"] <= sample["gap_max_ms"]
            assert sample["gap_max_ms"] > 0.5 * interval_ms
            # every measured stream's events, and those of the ramp and the drain, reached a client
            assert sample["events_total"] >= sample["streams"] * settings["events"]
            assert sum(count for count, _, _ in sample["timeline"]) == sample["streams"]
            assert load["client_cores"] > 0 and load["decode_cores"] > 0
            if path == "direct":
                assert load["hop_cores"] == 0 and load["hop_fds_peak"] == 0
            else:
                assert load["hop_rss_peak_mb"] > 1 and load["hop_us_per_event"] > 0
                assert load["hop_fds_peak"] >= settings["clients"]  # a socket per client at least
                per_event = load["hop_cores"] * sample["client_wall"] / sample["events_total"] * 1e6
                assert load["hop_us_per_event"] == pytest.approx(per_event)


def test_what_a_hop_adds_and_the_targets_follow_from_the_figures(report: dict[str, Any]) -> None:
    for run in report["runs"]:
        direct = run["paths"]["direct"]["sample"]
        assert sorted(run["added"]) == sorted(p for p in PATHS if p != "direct")
        for path, added in run["added"].items():
            sample = run["paths"][path]["sample"]
            for name in ("ttft_p50_ms", "ttft_p99_ms", "ttft_max_ms", "gap_p99_ms"):
                assert added[name] == pytest.approx(sample[name] - direct[name])
        expected = {"sidecar": {"ttft_p50_ms", "ttft_p99_ms", "errors", "hop_rss_peak_mb"}}
        expected["router"] = {"ttft_p99_ms"}
        assert {t["figure"] for t in run["targets"]} == expected[run["mode"]]
        for target in run["targets"]:
            assert target["passed"] == (target["value"] <= target["limit"])
            if target["figure"] == "ttft_p99_ms":
                assert target["value"] == pytest.approx(run["added"]["sidecar"]["ttft_p99_ms"])
                assert (target["nginx"] is None) is not NGINX
    for run in report["runs"]:
        assert f"round {run['round']}, {run['mode']} mode" in report["stdout"]
    verdicts = sum(len(run["targets"]) for run in report["runs"])
    sidecar_rounds = sum(run["mode"] == "sidecar" for run in report["runs"])
    verdicts += NGINX * sidecar_rounds  # the burst's, beside nginx
    verdicts += sidecar_rounds + 1  # the burst at two workers against one, per round and over all
    assert "two workers no worse than one in every round: " in report["stdout"]
    assert report["stdout"].count("  PASS") + report["stdout"].count("  MISS") == verdicts
