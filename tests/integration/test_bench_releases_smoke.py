"""``python -m bench --workload releases --quick`` runs end to end and its figures are sane.

The smoke run starts the real sim-prefill (TP 2, real NIXL agents), the
rejecting fake D and a sidecar releasing over NIXL, prefills on P, and runs
every step at a few hundred requests per second. It checks that every
request came back as D's 400 (the bench stops otherwise), that each release
reached P and P's own record of it is what the latencies come from, and that
the derived figures (kept up, where it stopped) follow from the measured ones.
Speed is not asserted.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.bench_runs import run_bench

# serial: the bench loads the machine (make test runs it alone)
pytestmark = [pytest.mark.nixl, pytest.mark.serial]


def test_quick_release_workload_reports_what_p_freed(tmp_path: Path) -> None:
    report, stdout = run_bench(tmp_path / "releases.json", "--workload", "releases", "--quick")
    settings = report["settings"]
    planned = [*settings["before"], [settings["rate"], settings["seconds"]], *settings["after"]]
    assert report["main"] == len(settings["before"])
    assert [s["rate"] for s in report["steps"]] == [rate for rate, _ in planned][: len(report["steps"])]
    assert report["prepared"] == sum(round(rate * secs) for rate, secs in planned)
    for step, (rate, seconds) in zip(report["steps"], planned, strict=False):
        assert step["sent"] == round(rate * seconds) == step["answered"]  # every one a 400 from D
        # released by the sidecar: every release P recorded, the sidecar counted sent; on a loaded
        # machine some may still be queued when the step's settle time ends, none counted twice
        assert 0 < step["freed"] <= step["sidecar_sent"] <= step["sent"]  # as P recorded it
        assert step["sidecar_sent"] + sum(step["sidecar_other"].values()) <= step["sent"]
        assert 0 <= step["freed_p50_ms"] <= step["freed_p99_ms"] <= step["freed_max_ms"]
        assert step["answer_p50_ms"] <= step["answer_p99_ms"]
        assert 0 <= step["sidecar_latency_p50_ms"] <= step["sidecar_latency_p99_ms"]  # its own histogram
        assert step["sidecar_cores"] > 0 and step["sidecar_rss_peak_mb"] > 1 and step["load_cores"] > 0
        assert step["backlog_end"] >= 0 and step["seconds"] >= seconds * 0.9
        expected = step["freed"] >= 0.99 * step["sent"] and step["freed_p99_ms"] <= 100
        assert step["kept_up"] is expected
    missed = [s["rate"] for s in report["steps"] if not s["kept_up"]]
    assert report["stopped_keeping_up"] == (min(missed) if missed else None)
    assert "<- main" in stdout and "target: " in stdout
