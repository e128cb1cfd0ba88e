"""docs/smg.md, run as written on the simulators: its ``bash`` blocks are read from the page.

Only what must change is changed. The page's ports become free ones and its
hosts' addresses loopback (P on the same host: the page's allowlist is then
``127.0.0.1``, the one case where loopback belongs in it); its "Try it without
GPUs" block starts the simulators in place of the two ``vllm serve`` commands,
and is held to them (``tests.integration.guides.check_simulators``); the
sidecar runs from this checkout's environment and smg from ``.tools/smg``
(``make test`` installs it, requirements/smg.txt). P, D and the sidecar start
in one process group, smg in another once they answer, as the page says; the
discovery file is written where smg runs.

Judged from P's own evidence (the simulator's ``/stats``, and the page's own
check of P's ``vllm:`` series): the request with D's key is served and read by
D; the one without is refused by D (401) and retried by smg five times, each
time a new prefill, and every one of the five is freed by the sidecar's
release, none by P's lease. Then with D stopped, the sidecar's 503s, which smg
also retries, are released under the page's ``--retried-statuses none``.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import httpx
import pytest

from tests.deploy.manifests import ROOT
from tests.e2e.evidence import P_SERIES
from tests.integration.guides import (
    HOSTS,
    SIDECAR,
    answers,
    bash,
    blocks,
    check_simulators,
    commands,
    flag,
    listener_pid,
    on_free_ports,
    port_of,
    runnable,
    sample,
    started,
    wait_closed,
)
from tests.support.ports import free_port
from tests.support.sims import p_stats, wait_stats
from tests.support.until import answered, until

pytestmark = pytest.mark.nixl

PAGE = ROOT / "docs" / "smg.md"
SMG = ROOT / ".tools" / "smg" / "bin" / "smg"
#: P, the sidecar (D's old port), D, smg, the sidecar's admin port, P's and D's side channels, smg's metrics.
PORTS = ("8100", "8200", "8201", "8000", "9100", "5600", "5601", "29000")
RETRIES = 5  # smg's --retry-max-retries default: attempts per request, each a new prefill
SENT = 'kvr_releases_total{result="sent",strategy="nixl"}'


def test_the_page_runs_on_the_simulators(tmp_path: Path) -> None:
    for needed in (SIDECAR, SMG):
        if not needed.exists():
            pytest.fail(f"{needed.relative_to(ROOT)} is missing: make test creates it")
    hosts, p, d, smg, workers, requests, sidecar_metrics, p_metrics, smg_metrics, sims = blocks(PAGE)
    assert HOSTS.findall(hosts) == ["P_HOST", "D_HOST"] and "D_KEY=" in hosts
    [p_serve], [d_serve, sidecar] = commands(p), commands(d)
    decode = port_of(flag(sidecar, "--decode-url"))
    assert (flag(p_serve, "--port"), decode) == ("8100", "8201")  # P's port; D's new port behind the sidecar
    assert flag(sidecar, "--port") == "8200" and flag(sidecar, "--retried-statuses") == "none"
    check_simulators(sims, [p_serve, d_serve], "8100", "8201")
    manifest, launch = commands(smg)
    assert flag(launch, "--discovery-file") == "smg-workers.json" and "--pd-disaggregation" in launch
    assert '"url": "http://$D_HOST:8200", "worker_type": "decode"' in manifest  # smg's D: the sidecar
    assert '"kv_connector": "NixlConnector"' in manifest and manifest.count('"model_id"') == 2

    ports = {port: str(free_port()) for port in PORTS}
    loopback = HOSTS.sub(r"\1=127.0.0.1", hosts)
    back_end = runnable(on_free_ports(sims, ports)) + runnable(on_free_ports(sidecar, ports)) + "\n"
    p_url, d_url = f"http://127.0.0.1:{ports['8100']}", f"http://127.0.0.1:{ports['8201']}"
    admin, front = f"http://127.0.0.1:{ports['9100']}", f"http://127.0.0.1:{ports['8000']}"
    with started(loopback + back_end, tmp_path / "p-d-sidecar.log", tmp_path):
        for url in (p_url + "/health", d_url + "/health", admin + "/readyz"):
            answered(url, timeout=60.0, poll=0.05)
        with started(
            loopback + runnable(on_free_ports(smg, ports), smg=str(SMG)), tmp_path / "smg.log", tmp_path
        ):
            answered(front + "/health", timeout=60.0, poll=0.05)
            listed = until_ready(loopback + on_free_ports(workers, ports), tmp_path)
            assert listed == {
                ("prefill", p_url, "NixlConnector", "Qwen/Qwen3-0.6B", "ready"),
                ("decode", f"http://127.0.0.1:{ports['8200']}", "None", "Qwen/Qwen3-0.6B", "ready"),
            }
            served, refused = answers(bash(loopback + on_free_ports(requests, ports), tmp_path))
            assert "error" not in served and served["choices"][0]["text"], served
            assert (
                refused["error"]["code"] == "decode_error" and "Unauthorized" in refused["error"]["message"]
            )
            stats = wait_stats(
                p_url, lambda s: s["requests_pinned"] == 1 + RETRIES and s["pinned_requests"] == 0
            )
            assert (stats["freed_by_notification"], stats["freed_by_expiry"], stats["notifs_unknown"]) == (
                1 + RETRIES,
                0,
                0,
            )
            counters = bash(on_free_ports(sidecar_metrics, ports), tmp_path)
            assert sample(counters, SENT) == RETRIES
            assert sample(counters, 'kvr_rejections_total{cause="rejected_4xx"}') == RETRIES
            assert sample(counters, 'kvr_not_released_total{cause="admitted",outcome="no_release"}') == 1
            p_series = bash(on_free_ports(p_metrics, ports), tmp_path)
            labels = '{engine="0",model_name="Qwen/Qwen3-0.6B"}'
            assert sample(p_series, P_SERIES["usage"] + labels) == 0.0
            assert f"{P_SERIES['expired']}{labels} 0.0" in p_series  # the check names real vLLM's series
            modes = bash(on_free_ports(smg_metrics, ports), tmp_path)
            assert sample(modes, 'smg_pd_kv_connector_mode_total{mode="nixl"}') == 1 + RETRIES
            assert "passthrough" not in modes
            d_down_is_released(front, p_url, int(ports["8201"]), admin)


def until_ready(workers: str, cwd: Path) -> set[tuple[str, ...]]:
    """The page's listing of smg's workers, once both are ready."""
    listed: list[set[tuple[str, ...]]] = [set()]

    def ready() -> bool:
        listed[0] = {tuple(line.split()) for line in bash(workers, cwd).splitlines() if line.strip()}
        return len(listed[0]) == 2 and all(entry[-1] == "ready" for entry in listed[0])

    until(ready, "smg's workers to be ready", 30.0, 0.05, state=lambda: listed[0])
    return listed[0]


def d_down_is_released(front: str, p_url: str, d_port: int, admin: str) -> None:
    """D stopped: the sidecar answers 503, smg retries the pair (new prefill each time), and under
    the page's ``--retried-statuses none`` every attempt is released (the shipped default would
    leave each to P's lease)."""
    os.kill(listener_pid(d_port), signal.SIGTERM)  # the simulated D this test started
    wait_closed(d_port)
    before, sent = p_stats(p_url), sample(httpx.get(admin + "/metrics").text, SENT)
    body = {"model": "Qwen/Qwen3-0.6B", "prompt": "D is gone", "max_tokens": 8}
    answer = httpx.post(front + "/v1/completions", json=body, timeout=60)
    assert answer.status_code == 503, answer.text
    pinned = before["requests_pinned"] + RETRIES
    after = wait_stats(p_url, lambda s: s["requests_pinned"] == pinned and s["pinned_requests"] == 0)
    assert after["freed_by_notification"] == before["freed_by_notification"] + RETRIES
    assert after["notifs_unknown"] == before["notifs_unknown"] and after["freed_by_expiry"] == 0
    assert sample(httpx.get(admin + "/metrics").text, SENT) == sent + RETRIES
