"""docs/vllm-router.md, run as written on the simulators: its ``bash`` blocks are read from the page.

Only what must change is changed. The page's ports become free ones and its
hosts' addresses loopback (P on the same host: the page's allowlist is then
``127.0.0.1``, the one case where loopback belongs in it); its "Try it without
GPUs" block starts the simulators in place of the two ``vllm serve`` commands,
and is held to them (``tests.integration.guides.check_simulators``); the
commands run from this checkout's environments, and the router's metrics port
is a free one. P, D and the sidecar start in one process group, the router in
another once they answer, as the page says.

Judged from P's own evidence (the simulator's ``/stats``, and the page's own
check of P's ``vllm:`` series): the request D serves is read by D; the one D
refuses before its handler is freed by the sidecar's one release; a 503 from
D is not retried by the router (one prefill, one decode attempt) and P frees
its blocks exactly once; with D stopped, the sidecar's 503 passes through the
router and, under the page's ``--retried-statuses none``, the sidecar
releases P's blocks. On one host the page's loopback allowlist keeps the
loopback warning and its alert's counter silent.
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
    d_attempts,
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
from tests.support.until import answered

pytestmark = pytest.mark.nixl

PAGE = ROOT / "docs" / "vllm-router.md"
#: P, the sidecar (D's old port), D, the router, the sidecar's admin port, P's and D's side channels.
PORTS = ("8100", "8200", "8201", "8000", "9100", "5600", "5601")
ROUTER = ROOT / ".tools" / "vllm-router" / "bin" / "vllm-router"
SENT = 'kvr_releases_total{result="sent",strategy="nixl"}'


def test_the_page_runs_on_the_simulators(tmp_path: Path) -> None:
    for needed in (SIDECAR, ROUTER):
        if not needed.exists():
            pytest.fail(f"{needed.relative_to(ROOT)} is missing: make test creates it")
    hosts, p, d, router, requests, sidecar_metrics, p_metrics, sims, _toy = blocks(PAGE)
    assert HOSTS.findall(hosts) == ["P_HOST", "D_HOST"]
    [p_serve], [d_serve, sidecar], [route] = commands(p), commands(d), commands(router)
    prefill, decode = port_of(flag(route, "--prefill")), port_of(flag(sidecar, "--decode-url"))
    assert (prefill, decode) == ("8100", "8201")  # P's port; D's new port, behind the sidecar's 8200
    assert port_of(flag(route, "--decode")) == "8200"  # the router's decode URL: the sidecar
    assert flag(sidecar, "--retried-statuses") == "none"
    check_simulators(sims, [p_serve, d_serve], prefill, decode)
    ports = {port: str(free_port()) for port in PORTS}
    loopback = HOSTS.sub(r"\1=127.0.0.1", hosts)
    back_end = runnable(on_free_ports(sims, ports)) + runnable(on_free_ports(sidecar, ports)) + "\n"
    front_end = runnable(on_free_ports(router, ports), **{"vllm-router": str(ROUTER)})
    front_end = front_end.rstrip().removesuffix("&") + f" --prometheus-port {free_port()} &\n"
    p_url, d_url = f"http://127.0.0.1:{ports['8100']}", f"http://127.0.0.1:{ports['8201']}"
    router_url, admin_url = (f"http://127.0.0.1:{ports[port]}" for port in ("8000", "9100"))
    with started(loopback + back_end, tmp_path / "p-d-sidecar.log", tmp_path):
        for url in (p_url + "/health", d_url + "/health", admin_url + "/readyz"):
            answered(url, timeout=60.0, poll=0.05)
        with started(loopback + front_end, tmp_path / "router.log", tmp_path):
            answered(router_url + "/health", timeout=60.0, poll=0.05)
            served, refused = answers(bash(on_free_ports(requests, ports), tmp_path))
            assert "error" not in served and served["choices"][0]["text"], served
            error = refused["error"]
            assert (error["code"], error["type"], error["param"]) == (
                400,
                "BadRequestError",
                "stream_options",
            )
            stats = wait_stats(p_url, lambda s: s["requests_pinned"] == 2 and s["pinned_requests"] == 0)
            assert (stats["freed_by_notification"], stats["freed_by_expiry"], stats["notifs_unknown"]) == (
                2,
                0,
                0,
            )
            counters = bash(on_free_ports(sidecar_metrics, ports), tmp_path)
            assert sample(counters, SENT) == 1
            assert sample(counters, 'kvr_not_released_total{cause="admitted",outcome="no_release"}') == 1
            # The page's allowlist names the loopback P: no warning, nothing for its alert to count.
            assert sample(httpx.get(admin_url + "/metrics").text, "kvr_nixl_loopback_targets_total") == 0
            assert "is a loopback address" not in (tmp_path / "p-d-sidecar.log").read_text()
            p_series = bash(on_free_ports(p_metrics, ports), tmp_path)
            labels = '{engine="0",model_name="Qwen/Qwen3-0.6B"}'
            assert f"{P_SERIES['usage']}{labels} 0.0" in p_series  # the check names real vLLM's series
            assert f"{P_SERIES['expired']}{labels} 0.0" in p_series
            not_retried(router_url, p_url, d_url)
            d_down_is_released(router_url, p_url, int(ports["8201"]), admin_url)


def not_retried(router_url: str, p_url: str, d_url: str) -> None:
    """A 503 from D reaches the client: one prefill, one decode attempt, P's blocks freed once."""
    before, attempts = p_stats(p_url), len(d_attempts(d_url))
    body = {"model": "Qwen/Qwen3-0.6B", "prompt": "busy [[reject:503]]", "max_tokens": 8}
    answer = httpx.post(router_url + "/v1/completions", json=body, timeout=30)
    assert answer.status_code == 503, answer.text
    after = wait_stats(p_url, lambda s: s["pinned_requests"] == 0)
    assert after["requests_pinned"] == before["requests_pinned"] + 1  # no second prefill
    assert len(d_attempts(d_url)) == attempts + 1  # no second decode attempt
    assert after["freed_by_notification"] == before["freed_by_notification"] + 1
    assert after["notifs_unknown"] == before["notifs_unknown"]  # freed once: nobody released it twice


def d_down_is_released(router_url: str, p_url: str, d_port: int, admin_url: str) -> None:
    """D stopped: the sidecar's 503 passes through the router, which retries nothing, and under the
    page's ``--retried-statuses none`` the sidecar releases P's blocks (the shipped default leaves
    a 503 to a retry on another decode server, which vllm-router never makes)."""
    os.kill(listener_pid(d_port), signal.SIGTERM)  # the simulated D this test started
    wait_closed(d_port)
    before, sent = p_stats(p_url), sent_releases(admin_url)
    body = {"model": "Qwen/Qwen3-0.6B", "prompt": "D is gone", "max_tokens": 8}
    answer = httpx.post(router_url + "/v1/completions", json=body, timeout=30)
    assert answer.status_code == 503 and "decode server" in answer.text, answer.text
    after = wait_stats(p_url, lambda s: s["pinned_requests"] == 0)
    assert after["requests_pinned"] == before["requests_pinned"] + 1
    assert after["freed_by_notification"] == before["freed_by_notification"] + 1
    assert after["notifs_unknown"] == before["notifs_unknown"]
    assert sent_releases(admin_url) == sent + 1


def sent_releases(admin_url: str) -> float:
    return sample(httpx.get(admin_url + "/metrics", timeout=5).text, SENT)
