"""A burst of requests whose kv_transfer_params name 262,144 blocks leaves no memory behind.

``python -m sidecar serve`` (release ``nixl``) runs as a child process in
front of the shared "vLLM D", which rejects each request (400, before its
handler), so every one is released to P. Each carries its real P request id
with a ``remote_block_ids`` list of 262,144 ids (about 2 MB of JSON). The
requests go one at a time, so one is in flight: the sidecar's resident
memory must not grow with the requests it has seen, and a minute after the
burst it must be back within 20 % of where it started. Slow (``make faults``).
"""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

from tests.faults.cluster import MODEL, VERSION, Backends, Flows
from tests.faults.sidecar_proc import child_sidecar

pytestmark = [pytest.mark.nixl, pytest.mark.slow_faults]

IDS = 262_144
BURST = 30
SETTLE = 60.0


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def test_a_burst_of_huge_block_lists_leaves_no_memory_behind(cluster: Backends) -> None:
    with child_sidecar(cluster.d.url, "--release-deadline", "10") as child:
        flows = Flows(cluster, "huge")
        client = httpx.Client(timeout=60)
        try:

            def reject(big: bool) -> None:
                request_id, params = flows.pin()
                if big:
                    params = {**params, "remote_block_ids": [list(range(1000, 1000 + IDS))]}
                body = {"model": MODEL, "prompt": "tok", "max_tokens": "x", "kv_transfer_params": params}
                answer = client.post(
                    child.url + "/v1/completions", json=body, headers={"x-request-id": request_id}
                )
                assert answer.status_code == 400, answer.text

            for _ in range(20):  # warm-up: ordinary rejections
                reject(big=False)
            time.sleep(1)
            start = rss_mb(child.proc.pid)
            samples = []
            for i in range(BURST):
                reject(big=True)
                samples.append(rss_mb(child.proc.pid))
                if i == 9:
                    after_ten = samples[-1]
            peak = max(samples)
            deadline = time.monotonic() + SETTLE
            while rss_mb(child.proc.pid) > start * 1.2 and time.monotonic() < deadline:
                time.sleep(1)
            settled = rss_mb(child.proc.pid)
            released = httpx.get(child.admin + "/metrics").text
        finally:
            client.close()
            flows.close()
    print(
        f"\n{BURST} requests x {IDS} block ids (vLLM {VERSION}, nixl): RSS {start:.0f} MB at the start, "
        f"{after_ten:.0f} MB after 10, peak {peak:.0f} MB, {settled:.0f} MB after it settled"
    )
    assert f'kvr_releases_total{{result="sent",strategy="nixl"}} {20 + BURST}.0' in released
    assert samples[-1] - after_ten < 0.1 * start, "memory grew with the requests seen"
    assert settled <= start * 1.2, f"RSS {settled:.0f} MB a minute after the burst, started at {start:.0f} MB"
