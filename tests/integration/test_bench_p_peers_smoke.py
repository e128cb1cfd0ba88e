"""``python -m bench.p_peers --quick`` runs end to end and its figures are sane.

The smoke run starts a real P agent (as vLLM 0.33.0 makes it, then without the
progress thread) and two real peer agents (the sidecar's ``NixlPeer``), each
in its own process on loopback: each peer handshakes over P's side channel and
sends notifications, and P must have received every one of them (the bench
exits 1 otherwise). It checks that every figure is there and sane; what the
figures are depends on the machine and is not asserted.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

# serial: the bench measures CPU and starts NIXL agents in several processes (make test runs it alone)
pytestmark = [pytest.mark.nixl, pytest.mark.serial, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], str]:
    out = tmp_path_factory.mktemp("p-peers") / "p-peers.json"
    result = subprocess.run(
        [sys.executable, "-m", "bench.p_peers", "--quick", "--json", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=540,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report: dict[str, Any] = json.loads(out.read_text())
    return report, result.stdout


def test_every_peer_connected_and_every_notification_reached_p(run: tuple[dict[str, Any], str]) -> None:
    report, _ = run
    assert report["settings"]["peers"] == [1, 2]
    assert [r["progress"] for r in report["runs"]] == ["thread", "poll"]
    each = report["settings"]["notifications_per_agent"]
    for r in report["runs"]:
        assert r["handshakes_served"] == 2  # one side-channel answer per peer agent
        assert [h["peer"] for h in r["handshakes"]] == [1, 2]
        bursts = [(n["agents"], n["notifications"], n["received"]) for n in r["notifications"]]
        assert bursts == [(1, 2 * each, 2 * each), (2, 2 * each, 2 * each)]
        assert r["metadata_bytes"] > 1000  # the agent's metadata lists its registered regions


def test_p_readings_and_per_peer_figures_are_sane(run: tuple[dict[str, Any], str]) -> None:
    report, stdout = run
    thread, poll = report["runs"]
    for r in report["runs"]:
        assert [i["peers"] for i in r["idle"]] == [0, 1, 2]
        for reading in r["idle"]:
            assert reading["rss_mb"] > 10 and reading["fds"] > 3 and reading["threads"] > 1
            assert reading["own_cores"] >= 0 and reading["nixl_cores"] >= 0
            assert reading["poll_us"] > 0 and reading["own_per_poll_us"] >= reading["poll_us"]
        fds = [reading["fds"] for reading in r["idle"]]
        assert fds == sorted(fds)  # a connected agent closes none of P's fds
        per = r["per_peer"]
        assert per["fds"] >= 0 and per["threads"] >= 0 and per["first_fds"] >= 0 and per["first_threads"] >= 0
        assert all(math.isfinite(value) for value in per.values())
        for h in r["handshakes"]:
            assert h["fetch_ms"] > 0 and h["add_ms"] > 0
            assert h["connect_ms"] >= h["fetch_ms"] + h["add_ms"]  # it includes both, timed by the peer
        assert per["fetch_ms"] > 0 and per["add_ms"] > 0 and per["connect_ms"] > 0
    # NIXL's progress thread is one thread more on P as vLLM makes it than without it
    assert [i["threads"] for i in thread["idle"]] == [i["threads"] + 1 for i in poll["idle"]]
    # Without the progress thread P's own drain does the UCX work: the first connection costs CPU
    first = poll["handshakes"][0]
    assert first["own_cpu_ms"] + first["nixl_cpu_ms"] > 0
    assert stdout.count("per extra peer:") == 2 and "until P has its first notification" in stdout
