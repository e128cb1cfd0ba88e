"""``kv-release-sidecar loadtest`` against the simulators: P (NIXL, TP 2), vLLM-D, the sidecar.

Real servers on ephemeral loopback ports; the load generator runs through
the CLI in the test's thread. A clean run passes, with the sidecar's
injected rejections released over NIXL and every one confirmed by P; a D
that sends P one extra notification for every request it admitted (what a
wrong release looks like from P) makes the verdict fail with exit code 1.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from sidecar.cli import main
from sidecar.sim.decode import create_decode_app
from sidecar.sim.decode.config import DecodeSimConfig
from sidecar.sim.decode.nixl import VllmDHooks, engine_request_id
from sidecar.sim.prefill import PrefillSimConfig, create_prefill_app
from sidecar.sim.servers import ServerThread, serve
from tests.support.runner import Sidecar, run_sidecar

# serial: the load generator loads the machine and its run is timed (make test runs it alone)
pytestmark = [pytest.mark.nixl, pytest.mark.serial]


class DoubleReleasingHooks(VllmDHooks):
    """A faulty D: after freeing an admitted request the normal way, it notifies every P
    rank once more through its ``DecodeClient``, as a wrong release would."""

    async def admitted(self, request_id: str, route: str, kv_transfer_params: dict[str, Any]) -> None:
        await super().admitted(request_id, route, kv_transfer_params)
        await self.client.release(kv_transfer_params, engine_request_id(route, request_id))


@contextmanager
def cluster(
    hooks: VllmDHooks, p_model: str | None = None, **sidecar: Any
) -> Iterator[tuple[ServerThread, ServerThread, Sidecar]]:
    # Both simulators serve their default model unless ``p_model`` sets P's apart.
    named = {"model": p_model} if p_model else {}
    p_config = PrefillSimConfig(
        port=0, tp=2, num_blocks=512, lease=10, side_channel_port=0, log_level="error", **named
    )
    d_config = DecodeSimConfig(port=0, event_delay=0.002, vllm_d=True)
    settings: dict[str, Any] = {"release": "nixl", "prefill_allow": ("127.0.0.1",), **sidecar}
    with (
        serve(create_prefill_app(p_config)) as p,
        serve(create_decode_app(d_config, hooks)) as d,
        run_sidecar(d.url, **settings) as sc,
    ):
        yield p, d, sc


def loadtest(p: ServerThread, sc: Sidecar, tmp_path: Path, *extra: str) -> tuple[int, dict[str, Any]]:
    report = tmp_path / "report.json"
    argv = [
        "loadtest",
        *("--prefill-url", p.url, "--decode-url", sc.url, "--sidecar-admin-url", sc.admin_url),
        *("--duration", "1.5", "--max-requests", "40", "--seed", "3", "--max-prompt", "96"),
        *("--report", str(report), "--drain-timeout", "10", "--progress", "off"),
        *extra,
    ]
    code = main(argv)
    return code, json.loads(report.read_text())


def test_clean_run_passes_and_every_injected_rejection_is_released(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with cluster(VllmDHooks("0.33.0"), inject_rate=0.3, inject_seed=5) as (p, _d, sc):
        plot = tmp_path / "plot.png"
        extra = ("--rate", "30", "--route", "chat", "--stream-share", "0.5", "--plot", str(plot))
        code, report = loadtest(p, sc, tmp_path, *extra)
    out = capsys.readouterr().out
    assert code == 0, out
    assert "verdict: PASS" in out
    assert report["verdict"]["ok"] and report["p_probe"] == "simulator"
    outcomes = report["requests"]["by_outcome"]
    injected = report["rejections"]["by_status"].get("503 (injected)", 0)
    assert injected > 0 and outcomes["ok"] > 0
    assert outcomes["ok"] + injected == report["requests"]["started"]
    assert report["releases"]["releases.sent"] == injected  # one release per injected rejection
    assert report["rejected_fates"] == {"freed_by_notification": injected}
    assert report["p"]["notifs_unknown"] == 0
    assert report["p"]["freed_by_notification"] == report["requests"]["started"]
    assert report["latency_ms"]["ttft"]["p50"] is not None
    assert any(flow["stream"] for flow in report["flows"]) and any(not f["stream"] for f in report["flows"])
    assert plot.read_bytes().startswith(b"\x89PNG")


@pytest.mark.parametrize("probe", ["stats", "metrics"])  # metrics: how a real vLLM P is read
def test_a_wrong_release_fails_the_verdict(
    probe: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with cluster(DoubleReleasingHooks("0.33.0")) as (p, _d, sc):
        extra = ("--concurrency", "4", "--max-requests", "12", "--prefill-probe", probe)
        code, report = loadtest(p, sc, tmp_path, *extra)
    out = capsys.readouterr().out
    assert code == 1, out
    assert "verdict: FAIL" in out and "wrong or double release" in out
    assert not report["verdict"]["ok"]
    assert report["p_probe"] == ("simulator" if probe == "stats" else "prometheus")
    started = report["requests"]["started"]
    assert started == 12 and report["requests"]["by_outcome"] == {"ok": 12}
    assert report["verdict"]["unknown_notifications"] == 2 * started  # one extra per request per rank
    assert report["p"]["blocks_total"] == 512 and report["p"]["peak_blocks_in_use"] is not None


def test_on_their_defaults_the_simulators_admit_and_the_verdict_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with cluster(VllmDHooks("0.33.0"), inject_rate=0.2, inject_seed=1) as (p, _d, sc):
        code, report = loadtest(p, sc, tmp_path, "--rate", "30")
    assert code == 0, capsys.readouterr().out
    admitted = [flow for flow in report["flows"] if flow["d_admitted"]]
    assert admitted and len(admitted) == report["requests"]["by_outcome"]["ok"]
    assert report["settings"]["model"] == "sim-model"


def test_a_run_d_rejects_entirely_fails_naming_the_cause(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # P and D serve different model names: D answers 404 to every decode leg, the sidecar
    # releases each one, and nothing was tested. The verdict must say so, and why.
    with cluster(VllmDHooks("0.33.0"), p_model="llama-p", inject_rate=0.2, inject_seed=1) as (p, _d, sc):
        code, report = loadtest(p, sc, tmp_path, "--rate", "30")
    out = capsys.readouterr().out
    assert code == 1, out
    started = report["requests"]["started"]
    injected = report["rejections"]["by_status"].get("503 (injected)", 0)
    own = started - injected
    assert 0 < injected < started and report["requests"]["by_outcome"] == {"rejected": started}
    line = next(line for line in out.splitlines() if line.startswith("verdict:"))
    assert line == (
        f"verdict: FAIL - D admitted none of the {started} flow(s); D rejected {own} of {started} "
        f"({own / started:.0%}, over --max-rejected-share 10%): "
        "404 model not found (P serves 'llama-p', D 'sim-model')"
    )


def test_bad_flags_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["loadtest", "--prefill-url", "http://127.0.0.1:1", "--decode-url", "http://127.0.0.1:2"]
    with pytest.raises(SystemExit) as both:
        main([*argv, "--rate", "5", "--concurrency", "2"])
    assert both.value.code == 2
    assert "--concurrency: not allowed with argument --rate" in capsys.readouterr().err
    with pytest.raises(SystemExit) as neither:
        main(argv)  # the defaults alone: one of the two is required, and the message says which
    assert neither.value.code == 2
    assert "one of the arguments --rate --concurrency is required" in capsys.readouterr().err


def test_help_says_rate_or_concurrency_is_required(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["loadtest", "--help"])
    out = capsys.readouterr().out
    assert "(--rate RATE | --concurrency CONCURRENCY)" in out
    assert "this or --concurrency is required" in " ".join(out.split())


def test_waits_for_readiness_and_says_what_was_not_ready(capsys: pytest.CaptureFixture[str]) -> None:
    # In a cluster the Job starts while P and D still load their model: --ready-timeout waits,
    # bounded, and names what never became ready.
    with socket.create_server(("127.0.0.1", 0)) as closed:
        dead = f"http://127.0.0.1:{closed.getsockname()[1]}"
    argv = ["loadtest", "--prefill-url", dead, "--decode-url", dead, "--rate", "5", "--duration", "1"]
    started = time.monotonic()
    assert main([*argv, "--ready-timeout", "1.5", "--progress", "off"]) == 1
    assert 1.4 < time.monotonic() - started < 10
    err = capsys.readouterr().err
    assert "not ready after 2 s" in err and f"{dead}/health" in err


def test_a_ready_cluster_is_not_waited_on(tmp_path: Path) -> None:
    with cluster(VllmDHooks("0.33.0")) as (p, _d, sc):
        started = time.monotonic()
        code, report = loadtest(
            p, sc, tmp_path, "--concurrency", "2", "--max-requests", "4", "--ready-timeout", "60"
        )
        assert code == 0 and report["requests"]["started"] == 4
        assert time.monotonic() - started < 30
