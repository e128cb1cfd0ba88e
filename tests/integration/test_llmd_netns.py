"""llm-d's guide args, unchanged, serve a P on another pod's address and release D's rejections.

Two network namespaces stand for two pods: the decode pod (the sidecar with the
guides' exact args ``--port=8000 --kv-connector=nixlv2 --zap-log-level=1
--secure-proxy=false``, and sim-decode as vLLM on 8200) and a prefill pod
(sim-prefill, TP 2, real NIXL, on its own address). The decode pod routes
between this namespace (the test's client) and the prefill pod, as a node
would. No allowlist is configured, as in the guides: the P the header names is
served, a D rejection is released over NIXL across the veth, and the addresses
no P can have (loopback, cloud metadata) are refused. Needs root (CAP_NET_ADMIN)
and ``ip``; skipped, with the reason, only when network namespaces cannot be made.
"""

from __future__ import annotations

import tempfile
from contextlib import ExitStack

import httpx
import pytest

from tests.integration.netns import pods, running, start_sims
from tests.support.runner import answers
from tests.support.sims import completion, wait_stats

pytestmark = [pytest.mark.nixl, pytest.mark.netns]
GUIDE_ARGS = ["--port=8000", "--kv-connector=nixlv2", "--zap-log-level=1", "--secure-proxy=false"]


def test_the_guides_args_serve_a_p_on_another_pod_and_release_a_rejection() -> None:
    with pods() as net, ExitStack() as stack:
        p_url, admin = start_sims(net, stack), f"http://{net.decode_ip}:9100"
        log = stack.enter_context(tempfile.TemporaryFile())
        sidecar = net.run(net.decode_ns, "serve", *GUIDE_ARGS, log=log)
        stack.enter_context(running(sidecar, log, "the sidecar", lambda: answers(admin + "/readyz")))
        url = f"http://{net.decode_ip}:8000/v1/completions"
        with httpx.Client(timeout=30) as client:
            name = "x-prefiller-host-port"
            two_lines = [(name, f"http://{p_url[7:]}"), (name, "10.0.0.1:1")]  # llm-d takes the first
            served = client.post(url, json=completion(20), headers=two_lines)
            assert served.status_code == 200, served.text
            after = wait_stats(p_url, lambda s: s["pinned_requests"] == 0)
            assert after["freed_by_notification"] == 1 and after["notifs_per_rank"] == [1, 1]  # D read them

            header = {"x-prefiller-host-port": p_url[7:]}
            rejected = client.post(url, json=completion(60, max_tokens="x"), headers=header)
            assert rejected.status_code == 400  # D's answer
            after = wait_stats(p_url, lambda s: s["pinned_requests"] == 0 and s["requests_pinned"] == 2)
            assert after["notifs_per_rank"] == [2, 2] and after["notifs_unknown"] == 0  # freed by the sidecar

            for target in ("127.0.0.1:8200", "169.254.169.254:80"):  # D's own vLLM, cloud metadata
                refused = client.post(url, json=completion(5), headers={name: target})
                assert refused.status_code == 403
                assert refused.text == "Forbidden: prefill target not allowed by SSRF protection\n"
            metrics = httpx.get(admin + "/metrics").text
            assert 'kvr_releases_total{result="sent",strategy="nixl"} 1.0' in metrics
            assert 'kvr_prefill_refused_total{reason="loopback"} 1.0' in metrics
            assert 'kvr_prefill_refused_total{reason="metadata"} 1.0' in metrics
            assert 'kvr_releases_enabled{reason="on"} 1.0' in metrics
        log.seek(0)
        started = log.read().decode()
        assert started.count("no prefill allowlist") == 1, started[-3000:]  # one warning at start
