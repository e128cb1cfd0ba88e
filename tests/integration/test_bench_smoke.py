"""``python -m bench --quick`` runs end to end and reports every path from its own measurements.

The smoke run starts the real sim-decode, sidecar and relay processes (and
nginx when the machine has it; it is not required), so it also checks that
every one answered every benchmark request correctly (the bench exits 1
otherwise). The JSON phases use wrk where it is installed and the Python
load generator where it is not; with wrk installed, a second run with
``--no-wrk`` covers the fallback too. Speed is not asserted: targets depend
on the machine. What is asserted is that the report holds every path and
that each derived figure (ratio, added time, cost, CPU share verdict,
target) follows from the measured ones.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bench.paths.saturation import bound

# serial: the bench loads the machine (make test runs it alone)
pytestmark = pytest.mark.serial

ROOT = Path(__file__).resolve().parents[2]
WRK = shutil.which("wrk") is not None
NGINX = shutil.which("nginx") is not None

JSON_FIGURES = ("requests", "seconds", "rps", "p50_ms", "p99_ms")
SSE_FIGURES = ("streams", "ttfb_p50_ms", "ttfb_p99_ms", "total_p50_ms", "total_p99_ms")
RATIOS = [f"{phase}.{name}" for phase in ("json_c32", "json_c1") for name in ("rps", "p50_ms", "p99_ms")] + [
    f"sse.{name}" for name in SSE_FIGURES[1:]
]
COST = {
    "cpu_ms_per_request_json_c32",
    "core_rps_json_c32",
    "cpu_ms_per_request_json_c1",
    "cpu_ms_per_sse_stream",
    "rss_idle_mb",
    "rss_load_mb",
}
PHASES = {"json_c32", "json_c1", "sse"}


def figure(figures: dict[str, Any], key: str) -> float:
    phase, name = key.split(".")
    return float(figures[phase][name])


def run_quick(tmp_path: Path, *flags: str) -> tuple[dict[str, Any], str, str]:
    out = tmp_path / "bench.json"
    result = subprocess.run(
        [sys.executable, "-m", "bench", "--quick", "--json", str(out), *flags],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(out.read_text()), result.stdout, result.stderr


def check_figures(figures: dict[str, Any]) -> None:
    for name in JSON_FIGURES:
        for phase in ("json_c32", "json_c1"):
            assert figures[phase][name] > 0, f"{phase}.{name}"
    for phase in ("json_c32", "json_c1"):
        assert figures[phase]["rps"] == pytest.approx(figures[phase]["requests"] / figures[phase]["seconds"])
    for name in SSE_FIGURES:
        assert figures["sse"][name] > 0, f"sse.{name}"


def check_hop(entry: dict[str, Any], direct: dict[str, Any], path: str) -> None:
    figures = entry["figures"]
    assert set(entry["ratios"]) == set(RATIOS)
    for key in RATIOS:
        assert entry["ratios"][key] == pytest.approx(figure(figures, key) / figure(direct, key)), (
            f"{path} {key}"
        )
    for which in ("p50", "p99"):
        added = figures["sse"][f"ttfb_{which}_ms"] - direct["sse"][f"ttfb_{which}_ms"]
        assert entry["ttfb_added"][f"{which}_ms"] == pytest.approx(added)
    cost = entry["cost"]
    assert set(cost) == COST
    assert cost["rss_idle_mb"] > 1 and cost["rss_load_mb"] > 1
    assert all(value >= 0 for value in cost.values())
    if cost["cpu_ms_per_request_json_c32"] > 0:  # a hop's CPU in a phase this short may be 0 ticks
        assert cost["core_rps_json_c32"] * cost["cpu_ms_per_request_json_c32"] == pytest.approx(1000)


def check_load(entry: dict[str, Any], path: str) -> None:
    assert set(entry["load"]) == PHASES
    for phase, load in entry["load"].items():
        shares = (load["client"], load["decode"], load["proxy"], load["other_load"], load["other_hop"])
        assert all(share >= 0 for share in shares), f"{path} {phase}"
        assert load["client"] > 0, f"{path} {phase}: the load generator's own clock saw it work"
        expected = bound(
            load["client"], load["decode"], load["proxy"], (load["other_load"], load["other_hop"])
        )
        assert load["bound"] == expected, f"{path} {phase}"
        if path == "direct":
            assert load["proxy"] == 0 and load["bound"] != "proxy"


def check_targets(report: dict[str, Any]) -> None:
    sidecar = report["results"]["sidecar"]
    nginx = report["results"].get("nginx")
    expected = {
        "cost.cpu_ms_per_request_json_c32": (sidecar["cost"]["cpu_ms_per_request_json_c32"], "<=", 0.10),
        "ratios.json_c32.rps": (sidecar["ratios"]["json_c32.rps"], ">=", 0.6),
        "ttfb_added.p99_ms": (
            sidecar["ttfb_added"]["p99_ms"],
            "<=",
            nginx["ttfb_added"]["p99_ms"] if nginx else None,
        ),
        "cost.rss_idle_mb": (sidecar["cost"]["rss_idle_mb"], "<", 60.0),
    }
    assert {target["figure"] for target in report["targets"]} == set(expected)
    for target in report["targets"]:
        value, op, limit = expected[target["figure"]]
        assert (target["value"], target["op"], target["limit"]) == (value, op, limit)
        if limit is None:
            assert target["passed"] is None
        else:
            assert target["passed"] == {"<=": value <= limit, ">=": value >= limit, "<": value < limit}[op]


def check_report(report: dict[str, Any], stdout: str, baseline: bool = False) -> None:
    paths = ["direct", "sidecar", *(["baseline"] if baseline else []), "relay", *(["nginx"] if NGINX else [])]
    assert report["paths"] == paths
    assert set(report["results"]) == set(paths)
    direct = report["results"]["direct"]
    assert direct["ratios"] is None and direct["cost"] is None and direct["ttfb_added"] is None
    for path, entry in report["results"].items():
        check_figures(entry["figures"])
        check_load(entry, path)
        if path != "direct":
            check_hop(entry, direct["figures"], path)
    assert report["client_saturated"] == [
        f"{phase} {path}"
        for path, entry in report["results"].items()
        for phase, load in entry["load"].items()
        if load["bound"] == "client"
    ]
    check_targets(report)
    header = next(line for line in stdout.splitlines() if line.startswith("figure"))
    assert header.split()[1 : 1 + len(paths)] == paths
    verdicts = [
        "n/a" if t["passed"] is None else "PASS" if t["passed"] else "MISS" for t in report["targets"]
    ]
    assert sum(stdout.count(mark) for mark in ("PASS", "MISS", "n/a (not measured)")) == len(verdicts)
    for item in report["client_saturated"]:
        assert item in stdout


def test_quick_bench_reports_every_path_with_wrk_or_its_fallback(tmp_path: Path) -> None:
    report, stdout, stderr = run_quick(tmp_path)
    assert report["json_client_is_wrk"] is WRK
    if WRK:
        assert report["json_client"].startswith("wrk ")
    else:
        assert "wrk not found on PATH" in report["json_client"]
        assert "wrk not found on PATH" in stdout and "wrk not found on PATH" in stderr
    check_report(report, stdout)
    if not WRK:
        return
    # With wrk installed, the fallback too, on request (without wrk, the run above is the fallback);
    # this run also measures a baseline sidecar started from a checkout (this one), as --baseline does.
    report, stdout, stderr = run_quick(tmp_path, "--no-wrk", "--baseline", str(ROOT))
    assert report["json_client_is_wrk"] is False
    assert report["json_client"].startswith("the Python load generator")
    assert "--no-wrk given" in stdout and "--no-wrk given" in stderr
    check_report(report, stdout, baseline=True)
