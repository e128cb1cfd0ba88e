"""docs/vllm-router.md's section on vLLM's reference proxy, run on the simulators: opt-in.

``toy_proxy_server.py`` lives in vLLM's source tree (``tests/v1/kv_connector/
nixl_integration/``) and in no package, so this test runs it only where
``KVR_VLLM_TOY_PROXY`` names that file (from a checkout of vLLM at the release
P and D run); it runs with this checkout's Python, which has the fastapi, httpx
and uvicorn it needs. The page's simulator block and the sidecar's command
start P, D and the sidecar; the page's proxy command runs in place of the
router. Judged from P's own evidence: the served request is read by D, the
request D refuses before its handler (``stream_options`` without ``stream``,
which the proxy drops from P's leg only) is freed by the sidecar's one
release, and the proxy sent each request once (one prefill, one decode
attempt).
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path

import httpx
import pytest

from tests.deploy.manifests import ROOT
from tests.integration.guides import (
    HOSTS,
    blocks,
    commands,
    d_attempts,
    on_free_ports,
    runnable,
    sample,
    started,
)
from tests.support.ports import free_port
from tests.support.sims import wait_stats
from tests.support.until import answered

pytestmark = pytest.mark.nixl

PAGE = ROOT / "docs" / "vllm-router.md"
PORTS = ("8100", "8200", "8201", "8000", "9100", "5600", "5601")
PYTHON = ROOT / ".venv" / "bin" / "python"
MODEL = "Qwen/Qwen3-0.6B"


def toy_proxy() -> Path:
    where = os.environ.get("KVR_VLLM_TOY_PROXY", "")
    if not where:
        pytest.skip("KVR_VLLM_TOY_PROXY is unset: the path of toy_proxy_server.py from vLLM's source")
    path = Path(where)
    if not path.is_file():
        pytest.fail(f"KVR_VLLM_TOY_PROXY={where}: no such file")
    return path


def test_the_reference_proxy_section_runs_on_the_simulators(tmp_path: Path) -> None:
    proxy = toy_proxy()
    hosts, _p, d, _router, _requests, _sidecar_metrics, _p_metrics, sims, toy = blocks(PAGE)
    [command] = commands(toy)
    assert shlex.split(command)[:2] == ["python", "toy_proxy_server.py"]
    [_, sidecar] = commands(d)
    ports = {port: str(free_port()) for port in PORTS}
    loopback = HOSTS.sub(r"\1=127.0.0.1", hosts)
    back_end = runnable(on_free_ports(sims, ports)) + runnable(on_free_ports(sidecar, ports)) + "\n"
    front_end = on_free_ports(command, ports).replace("python toy_proxy_server.py", f"{PYTHON} {proxy}", 1)
    p_url, d_url = f"http://127.0.0.1:{ports['8100']}", f"http://127.0.0.1:{ports['8201']}"
    proxy_url, admin_url = (f"http://127.0.0.1:{ports[port]}" for port in ("8000", "9100"))
    with started(loopback + back_end, tmp_path / "p-d-sidecar.log", tmp_path):
        for url in (p_url + "/health", d_url + "/health", admin_url + "/readyz"):
            answered(url, timeout=60.0, poll=0.05)
        with started(loopback + front_end + "\n", tmp_path / "proxy.log", tmp_path):
            answered(proxy_url + "/healthcheck", timeout=60.0, poll=0.05)
            body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 8}
            served = httpx.post(proxy_url + "/v1/completions", json=body, timeout=30)
            assert served.status_code == 200 and served.json()["choices"][0]["text"], served.text
            refused = {**body, "stream_options": {"include_usage": True}}
            with pytest.raises(httpx.HTTPError):  # the proxy streams D's 400: the answer is cut short
                httpx.post(proxy_url + "/v1/completions", json=refused, timeout=30).read()
            stats = wait_stats(p_url, lambda s: s["requests_pinned"] == 2 and s["pinned_requests"] == 0)
            assert (stats["freed_by_notification"], stats["freed_by_expiry"], stats["notifs_unknown"]) == (
                2,
                0,
                0,
            )
            assert len(d_attempts(d_url)) == 2  # one decode attempt per request
            metrics = httpx.get(admin_url + "/metrics").text
            assert sample(metrics, 'kvr_releases_total{result="sent",strategy="nixl"}') == 1
