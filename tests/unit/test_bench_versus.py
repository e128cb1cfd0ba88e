"""Router mode beside vllm-router and one worker beside two (``bench.streams.versus``), and the fake
P's check of a prefill leg (``bench.servers.fakes``): pure readings of made-up figures."""

from __future__ import annotations

import msgspec
import pytest

from bench.cli import build_parser
from bench.harness.procs import BenchError
from bench.servers.fakes import prefill_refusal
from bench.streams.cstreams import StreamsSample
from bench.streams.report import HopLoad, PathRun
from bench.streams.run import VLLM_ROUTER_PATHS
from bench.streams.run import settings as streams_settings
from bench.streams.versus import RATE_SLACK, rate, versus, versus_lines, workers_burst, workers_lines
from bench.streams.vllm_router import INSTALLED, argv

SECONDS, EVENTS = 10.0, 64


def _run(streams: int, p99: float, *, burst_p99: float | None = None, client: float = 0.3) -> PathRun:
    def sample(streams: int, p99: float) -> StreamsSample:
        return StreamsSample(
            clients=2000, streams=streams, ttft_p50_ms=p99 / 2, ttft_p90_ms=p99 / 1.5, ttft_p99_ms=p99,
            ttft_max_ms=p99 * 2, gap_p50_ms=31.0, gap_p99_ms=40.0, gap_max_ms=50.0, errors=0,
            first_errors=[], statuses={}, events_total=(streams + 2000) * (EVENTS + 1), reconnects=0,
            client_cpu=1.0, client_wall=12.0, timeline=[],
        )  # fmt: skip

    load = HopLoad(
        hop_cores=0.8, hop_us_per_event=10.0, hop_us_per_stream=650.0, hop_rss_peak_mb=80.0,
        hop_fds_peak=4000, client_cores=client, decode_cores=0.4, other_load_core=0.0, other_hop_core=0.0,
    )  # fmt: skip
    burst = None if burst_p99 is None else sample(500, burst_p99)
    total = streams + 2000
    prefill = {"legs": total, "with_request_id": total, "with_min_tokens": 0, "refused": 0, "other": 0}
    return PathRun(sample=sample(streams, p99), load=load, burst=burst, prefill=prefill)


@pytest.mark.parametrize(
    ("ours", "theirs", "passed"),
    [
        ((9000, 30.0), (9000, 30.0), True),  # level on both: at
        ((9000, 20.0), (8000, 50.0), True),  # ahead on both
        ((9000 * (1 - RATE_SLACK), 30.0), (9000, 30.0), True),  # within the slack on rate
        ((8800, 30.0), (9000, 30.0), False),  # behind on rate, past the slack
        ((9000, 30.1), (9000, 30.0), False),  # behind on p99
    ],
)
def test_the_sidecar_passes_when_at_or_ahead_of_vllm_router_on_rate_and_p99(
    ours: tuple[int, float], theirs: tuple[int, float], passed: bool
) -> None:
    paths = {"sidecar": _run(int(ours[0]), ours[1]), "vllm-router": _run(theirs[0], theirs[1])}
    [judged] = versus(paths, SECONDS)
    assert (judged.ours, judged.theirs, judged.passed) == ("sidecar", "vllm-router", passed)
    assert judged.rate == rate(paths["sidecar"], SECONDS) == int(ours[0]) / SECONDS
    assert (judged.ttft_p99_ms, judged.their_ttft_p99_ms) == ours[1:] + theirs[1:]


def test_each_pair_is_judged_only_when_both_of_its_paths_ran() -> None:
    paths = {"sidecar": _run(9000, 30.0), "sidecar-w2": _run(9500, 20.0), "vllm-router-w2": _run(9000, 25.0)}
    assert [(v.ours, v.theirs, v.passed) for v in versus(paths, SECONDS)] == [
        ("sidecar-w2", "vllm-router-w2", True)
    ]
    assert versus({"sidecar": _run(9000, 30.0)}, SECONDS) == []


def test_the_side_by_side_table_prints_every_path_the_verdicts_and_what_each_hop_sends() -> None:
    paths = {
        "direct": _run(9900, 5.0),
        "sidecar": _run(9000, 30.0),
        "vllm-router": _run(9100, 20.0, client=0.95),
    }
    lines = versus_lines(paths, versus(paths, SECONDS), SECONDS, EVENTS)
    text = "\n".join(lines)
    rows = {line.split()[0]: line.split() for line in lines[2:5]}
    assert sorted(rows) == ["direct", "sidecar", "vllm-router"]
    assert rows["sidecar"][1:6] == ["900", "15.0", "30.0", "40.0", "650"]
    assert rows["direct"][5] == "-"  # no hop
    assert rows["sidecar"][-2:] == ["1.00/1.00/0.00/0.00", "(0)"]  # per stream of the phase
    assert "one core each: sidecar 900 streams/s, TTFT p99 30.0 ms; vllm-router 910, 20.0" in text
    assert text.count("  MISS") == 1 and "  PASS" not in text
    assert "load generator used over 0.9 of its core on vllm-router" in text
    assert "vllm-router sends P:" in text and "sidecar sends P:" in text
    assert versus_lines({"direct": paths["direct"], "sidecar": paths["sidecar"]}, [], SECONDS, EVENTS) == []


def test_two_workers_pass_a_round_when_their_burst_p99_is_no_worse_than_one_worker_s() -> None:
    def round_(one: float, two: float) -> dict[str, PathRun]:
        return {"sidecar": _run(9000, 30.0, burst_p99=one), "sidecar-w2": _run(9000, 30.0, burst_p99=two)}

    assert workers_burst({"sidecar": _run(9000, 30.0, burst_p99=40.0)}) is None
    assert workers_burst({"sidecar": _run(9000, 30.0), "sidecar-w2": _run(9000, 30.0)}) is None
    judged = [(1, workers_burst(round_(40.0, 35.0))), (2, workers_burst(round_(40.0, 40.0)))]
    rounds = [(r, w) for r, w in judged if w is not None]
    assert [w.passed for _, w in rounds] == [True, True]
    lines = workers_lines(rounds)
    assert lines[1] == "round 1: burst TTFT p99, 1 worker 40.0 ms, 2 workers 35.0 ms  PASS"
    assert lines[-1] == "two workers no worse than one in every round: 2 of 2  PASS"
    missed = workers_burst(round_(40.0, 40.5))
    assert missed is not None and not missed.passed
    assert workers_lines([*rounds, (3, missed)])[-1].endswith("2 of 3  MISS")
    assert workers_lines([]) == []


LEG = {
    "model": "m",
    "messages": [],
    "stream": False,
    "max_tokens": 1,
    "kv_transfer_params": {"do_remote_decode": True},
}


@pytest.mark.parametrize(
    ("change", "refused"),
    [
        ({}, None),
        ({"min_tokens": 1}, None),  # vllm-router's
        ({"stream": True}, "stream True, max_tokens 1"),
        ({"max_tokens": 64}, "max_tokens 64"),
        ({"kv_transfer_params": None}, "no kv_transfer_params"),
        ({"kv_transfer_params": {"do_remote_decode": False}}, "no kv_transfer_params"),
        ({"max_tokens": "1"}, "Expected `int | null`"),
    ],
)
def test_the_fake_p_answers_only_a_prefill_leg(change: dict[str, object], refused: str | None) -> None:
    found = prefill_refusal(msgspec.json.encode({**LEG, **change}))
    assert found == refused if refused is None else refused in (found or "")


def test_vllm_router_runs_only_when_named_and_from_the_given_launcher() -> None:
    default = streams_settings(build_parser().parse_args(["--workload", "streams"]))
    assert not set(VLLM_ROUTER_PATHS) & set(default.paths) and default.vllm_router == str(INSTALLED)
    args = ["--workload", "streams", "--paths", "sidecar,vllm-router", "--vllm-router", "/opt/vr"]
    named = streams_settings(build_parser().parse_args(args))
    assert (named.paths, named.vllm_router) == (("sidecar", "vllm-router"), "/opt/vr")


def test_the_launcher_must_exist_and_runs_as_the_page_does_with_round_robin() -> None:
    with pytest.raises(BenchError, match="make bench installs it"):
        argv("/nonexistent/vllm-router", "http://p", "http://d", 1)
    command = argv(str(INSTALLED) if INSTALLED.exists() else __file__, "http://p:1", "http://d:2", 3)
    assert command[1:6] == ["--vllm-pd-disaggregation", "--prefill", "http://p:1", "--decode", "http://d:2"]
    flags = dict(zip(command[6::2], command[7::2], strict=True))
    assert flags["--port"] == "3" and flags["--policy"] == "round_robin"
