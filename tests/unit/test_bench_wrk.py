"""wrk's Lua script and the parsing of what its ``done`` hook prints."""

from __future__ import annotations

import pytest

from bench.harness.load import Sample, request_body
from bench.harness.procs import BenchError
from bench.paths.measure import stalled
from bench.paths.wrk import lua_script, parse

WRK_REPORT = """\
Running 1s test @ http://127.0.0.1:8000/v1/chat/completions
  1 threads and 32 connections
Requests/sec:   3000.00
"""


def output(summary: str, buckets: list[tuple[int, int]]) -> str:
    return WRK_REPORT + f"bench-summary {summary}\n" + "".join(f"bench-latency {v} {c}\n" for v, c in buckets)


def test_the_script_posts_the_request_body_verbatim() -> None:
    body = request_body(False, 128)
    script = lua_script(body)
    assert 'wrk.method = "POST"' in script
    assert 'wrk.headers["Content-Type"] = "application/json"' in script
    assert f"wrk.body = [==[{body.decode()}]==]" in script
    assert b'"max_tokens":128' in body
    assert "os.clock()" in script  # the CPU is read before the histogram is printed


def test_a_body_that_would_end_the_lua_string_is_refused() -> None:
    with pytest.raises(ValueError, match="Lua long string"):
        lua_script(b'{"x": "]==]"}')


def test_requests_wall_cpu_and_the_histogram_come_from_the_done_hook() -> None:
    sample = parse(output("5 2000000 0.250000 0 0 0 0 0", [(1500, 2), (2500, 4)]))
    assert sample.requests() == 5  # the summary's count, not the histogram's (it adds corrected samples)
    assert sample.completed == 5
    assert sample.wall == 2.0
    assert sample.client_cpu == 0.25
    assert sample.latencies == [0.0015] * 2 + [0.0025] * 4
    assert sample.errors == 0 and sample.first_errors == []


def test_every_kind_of_error_wrk_counts_fails_the_sample() -> None:
    sample = parse(output("10 1000000 0.1 1 2 0 3 4", [(1000, 10)]))
    assert sample.errors == 10
    assert sample.first_errors == [
        "wrk counted 1 connect error(s)",
        "wrk counted 2 read error(s)",
        "wrk counted 3 status error(s)",
        "wrk counted 4 timeout error(s)",
    ]


@pytest.mark.parametrize(
    "text",
    [WRK_REPORT, output("5 2000000 0.2 0 0 0 0", []), output("5 2000000 0.2 0 0 0 0 0", [])],
    ids=["no summary", "short summary", "no histogram"],
)
def test_output_without_the_hook_s_figures_breaks_the_bench(text: str) -> None:
    with pytest.raises(BenchError, match="wrk printed no"):
        parse(text)


def test_a_run_that_completed_nothing_without_errors_is_a_stall_not_a_failure() -> None:
    stalled_run = parse(output("0 1000000 0.01 0 0 0 0 0", []))
    assert stalled(stalled_run) and stalled_run.requests() == 0
    assert not stalled(parse(output("0 1000000 0.01 0 0 0 0 2", [])))  # timeouts are failures
    assert not stalled(Sample(latencies=[0.001]))  # the Python client's samples never stall
