"""The bench report: ratios and costs from the figures, the sidecar's targets, the printed table."""

from __future__ import annotations

import pytest

from bench.harness.report import Environment
from bench.paths.render import render
from bench.paths.report import (
    JsonFigures,
    PathFigures,
    PathReport,
    ProxyCost,
    Report,
    SseFigures,
    client_saturated,
    path_report,
    targets,
)
from bench.paths.saturation import PhaseLoad, bound


def figures(rps: float, ttfb_p99_ms: float) -> PathFigures:
    json = JsonFigures(requests=int(rps), seconds=1.0, rps=rps, p50_ms=1.0, p99_ms=2.0)
    sse = SseFigures(streams=10, ttfb_p50_ms=0.5, ttfb_p99_ms=ttfb_p99_ms, total_p50_ms=2.0, total_p99_ms=3.0)
    return PathFigures(json_c1=json, json_c32=json, sse=sse)


def cost(cpu_ms: float, rss_idle_mb: float) -> ProxyCost:
    return ProxyCost(
        cpu_ms_per_request_json_c32=cpu_ms,
        core_rps_json_c32=1000 / cpu_ms,
        cpu_ms_per_request_json_c1=cpu_ms,
        cpu_ms_per_sse_stream=1.0,
        rss_idle_mb=rss_idle_mb,
        rss_load_mb=rss_idle_mb + 1,
    )


def load(client: float, decode: float, proxy: float) -> dict[str, PhaseLoad]:
    entry = PhaseLoad(
        client=client,
        decode=decode,
        proxy=proxy,
        other_load=0.0,
        other_hop=0.0,
        bound=bound(client, decode, proxy),
    )
    return dict.fromkeys(("json_c32", "json_c1", "sse"), entry)


def results(nginx: bool) -> dict[str, PathReport]:
    direct = figures(10_000, 1.0)
    out = {
        "direct": path_report(direct, direct, None, load(0.6, 0.4, 0.0)),
        "sidecar": path_report(figures(5_000, 1.5), direct, cost(0.15, 42.0), load(0.1, 0.3, 0.99)),
        "relay": path_report(figures(8_000, 1.3), direct, cost(0.04, 24.0), load(0.2, 0.6, 0.3)),
    }
    if nginx:
        out["nginx"] = path_report(figures(8_500, 1.4), direct, cost(0.04, 12.0), load(0.2, 0.6, 0.3))
    return out


def report(entries: dict[str, PathReport]) -> Report:
    return Report(
        quick=True,
        cores="test",
        json_client="wrk 4.1.0 (/usr/bin/wrk), one thread",
        json_client_is_wrk=True,
        settings={},
        rounds=1,
        paths=list(entries),
        seconds=1.0,
        results=entries,
        targets=targets(entries),
        client_saturated=client_saturated(entries),
        environment=Environment(loadavg_start=0.0, loadavg_end=0.0, other_cpu={}, disturbed=False),
        stopped_early=[],
    )


def test_a_hop_s_ratios_and_added_ttfb_are_computed_from_its_figures_and_direct_s() -> None:
    sidecar = results(nginx=False)["sidecar"]
    assert sidecar.ratios is not None and sidecar.ttfb_added is not None
    assert sidecar.ratios["json_c32.rps"] == 0.5
    assert sidecar.ratios["sse.ttfb_p99_ms"] == 1.5
    assert sidecar.ttfb_added.p99_ms == pytest.approx(0.5)
    assert results(nginx=False)["direct"].ratios is None


def test_targets_judge_the_sidecar_against_direct_and_nginx() -> None:
    judged = {target.figure: target for target in targets(results(nginx=True))}
    assert judged["cost.cpu_ms_per_request_json_c32"].passed is False  # 0.15 > 0.10
    assert judged["ratios.json_c32.rps"].passed is False  # 0.5 < 0.6
    ttfb = judged["ttfb_added.p99_ms"]
    assert ttfb.limit == pytest.approx(0.4) and ttfb.value == pytest.approx(0.5) and ttfb.passed is False
    assert judged["cost.rss_idle_mb"].passed is True  # 42 < 60


def test_without_nginx_the_ttfb_target_is_not_judged() -> None:
    judged = {target.figure: target for target in targets(results(nginx=False))}
    assert judged["ttfb_added.p99_ms"].limit is None and judged["ttfb_added.p99_ms"].passed is None


def test_the_client_saturating_is_reported_per_phase_and_path() -> None:
    assert client_saturated(results(nginx=False)) == ["json_c32 direct", "json_c1 direct", "sse direct"]


def test_the_table_has_a_column_per_path_and_a_verdict_per_target() -> None:
    text = render(report(results(nginx=False)))
    header = next(line for line in text.splitlines() if line.startswith("figure"))
    assert header.split()[1:4] == ["direct", "sidecar", "relay"]
    assert "JSON load generator: wrk 4.1.0" in text
    assert text.count("MISS") == 2 and text.count("PASS") == 1 and text.count("n/a (not measured)") == 1
    rps = next(line for line in text.splitlines() if line.startswith("JSON 32 conns  req/s"))
    assert "0.50x" in rps and "0.80x" in rps and ">= 0.6 x direct  MISS" in rps
    assert "WARNING: the load generator, not the hop, hit 100 % of its core in: json_c32 direct" in text
    assert "not judged: ttfb_added.p99_ms" in text
