"""The e2e harness's own measurements: stalls it saw, and the light traffic it gives P."""

from __future__ import annotations

import threading
import time

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from sidecar.sim.servers import serve
from tests.e2e.stalls import StallWatch
from tests.e2e.traffic import Traffic


def test_the_watch_keeps_the_worst_stall_since_its_reset() -> None:
    with StallWatch(tick=0.01) as watch:
        watch.note(100.0, 103.5)  # P's /metrics answered after 3.5 s
        assert watch.worst == 3.5
        assert watch.worst_gap < 1.0  # the harness itself did not stall
        watch.reset()
        assert watch.worst < 1.0


def test_a_stall_counts_only_for_the_part_inside_a_window() -> None:
    watch = StallWatch()
    watch.note(100.0, 103.5)
    watch.note(200.0, 200.3)  # too short to be kept
    assert watch.longest_within(90.0, 120.0) == 3.5
    assert watch.longest_within(102.0, 130.0) == 1.5  # began before the window
    assert watch.longest_within(104.0, 199.0) == 0.0  # ended before the window
    assert watch.longest_within(199.0, 201.0) == 0.0
    watch.reset()
    assert watch.longest_within(90.0, 120.0) == 3.5  # a reset keeps what was recorded


def test_the_watch_sees_the_harness_itself_stall() -> None:
    with StallWatch(tick=0.01) as watch:
        watch.reset()
        sum(range(50_000_000))  # one C call holding the interpreter: the ticking thread cannot run
        time.sleep(0.05)
        assert watch.worst_gap > 0.1
        assert watch.worst >= watch.worst_gap


def test_traffic_sends_one_token_requests_without_kv_params_until_the_block_ends() -> None:
    bodies: list[dict[str, object]] = []
    seen = threading.Event()

    async def completions(request: Request) -> JSONResponse:
        bodies.append(await request.json())
        if len(bodies) >= 3:
            seen.set()
        return JSONResponse({"choices": [{"text": "a"}]})

    app = Starlette(routes=[Route("/v1/completions", completions, methods=["POST"])])
    with serve(app) as server, Traffic(server.url, "m", interval=0.01) as traffic:
        assert seen.wait(10)
    count = len(bodies)
    time.sleep(0.1)
    assert len(bodies) == count  # stopped with the block
    assert traffic.sent >= 3 and traffic.failed == 0
    assert all(body == {"model": "m", "prompt": "ka", "max_tokens": 1} for body in bodies)


def test_traffic_counts_failures_and_goes_on() -> None:
    with Traffic("http://127.0.0.1:9", "m", interval=0.01) as traffic:
        deadline = time.monotonic() + 10
        while traffic.failed < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
    assert traffic.failed >= 2 and traffic.sent == 0
