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

import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import IO, Any

import httpx
import pytest

from tests.integration.test_router import completion
from tests.support.sims import wait_stats
from tests.support.until import until

pytestmark = [pytest.mark.nixl, pytest.mark.netns]
GUIDE_ARGS = ["--port=8000", "--kv-connector=nixlv2", "--zap-log-level=1", "--secure-proxy=false"]
VERSION = "0.33.0"


@dataclass(frozen=True)
class Pods:
    decode_ns: str
    prefill_ns: str
    decode_ip: str  # the decode pod as this namespace reaches it
    prefill_ip: str  # the prefill pod's address

    def run(self, ns: str, *argv: str, log: IO[bytes]) -> subprocess.Popen[bytes]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVR_")}
        command = ["ip", "netns", "exec", ns, sys.executable, "-m", "sidecar", *argv]
        return subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")


@contextmanager
def pods() -> Iterator[Pods]:
    """this namespace --(a)-- decode pod --(b)-- prefill pod, the decode pod forwarding."""
    if shutil.which("ip") is None:
        pytest.skip("the ip tool (iproute2) is not installed: no network namespaces")
    tag, net = f"{os.getpid() % 10000}{random.randrange(100)}", random.randrange(256)
    a, b = f"10.216.{net}", f"10.217.{net}"
    decode, prefill = f"kvrd{tag}", f"kvrp{tag}"
    try:
        _ip("netns", "add", decode)
    except RuntimeError as exc:
        pytest.skip(f"ip netns is not permitted here ({exc})")
    links = (f"kvra{tag}", f"kvrA{tag}", f"kvrb{tag}", f"kvrB{tag}")
    try:
        _ip("netns", "add", prefill)
        _ip("link", "add", links[0], "type", "veth", "peer", "name", links[1])
        _ip("link", "add", links[2], "type", "veth", "peer", "name", links[3])
        _ip("link", "set", links[1], "netns", decode)
        _ip("link", "set", links[2], "netns", decode)
        _ip("link", "set", links[3], "netns", prefill)
        _ip("addr", "add", f"{a}.1/30", "dev", links[0])
        _ip("link", "set", links[0], "up")
        _ip("route", "add", f"{b}.0/30", "via", f"{a}.2")
        for ns, commands in (
            (decode, [f"addr add {a}.2/30 dev {links[1]}", f"addr add {b}.1/30 dev {links[2]}"]),
            (prefill, [f"addr add {b}.2/30 dev {links[3]}", f"link set {links[3]} up"]),
        ):
            for command in [*commands, "link set lo up"]:
                _ip("netns", "exec", ns, "ip", *command.split())
        for link in links[1:3]:
            _ip("netns", "exec", decode, "ip", "link", "set", link, "up")
        _ip("netns", "exec", prefill, "ip", "route", "add", "default", "via", f"{b}.1")
        subprocess.run(
            ["ip", "netns", "exec", decode, "sysctl", "-qw", "net.ipv4.ip_forward=1"], check=True
        )  # the decode pod's namespace only: the node routes between pods
        yield Pods(decode, prefill, f"{a}.2", f"{b}.2")
    finally:
        for ns in (decode, prefill):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)
        subprocess.run(["ip", "link", "del", links[0]], capture_output=True, check=False)


@contextmanager
def running(process: subprocess.Popen[bytes], log: IO[bytes], what: str, ready: Any) -> Iterator[None]:
    try:

        def started() -> bool:
            if process.poll() is not None:
                log.seek(0)
                raise AssertionError(f"{what} exited {process.returncode}: {log.read().decode()[-3000:]}")
            return bool(ready())

        until(started, f"{what} to start", 60.0, 0.05)
        yield
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def start_sims(net: Pods, stack: ExitStack) -> str:
    """sim-prefill (TP 2, real NIXL) on the prefill pod's address and sim-decode as vLLM on the decode
    pod's 8200, both answering; P's URL."""
    logs = [stack.enter_context(tempfile.TemporaryFile()) for _ in range(2)]  # noqa: SIM115 - the stack closes them
    p_url = f"http://{net.prefill_ip}:8000"
    p = net.run(
        net.prefill_ns,
        *("sim-prefill", "--host", net.prefill_ip, "--port", "8000", "--tp", "2", "--lease", "0"),
        *("--side-channel-host", net.prefill_ip, "--side-channel-port", "5600"),
        *("--num-blocks", "64", "--model", "m", "--vllm-version", VERSION, "--log-level", "warning"),
        log=logs[0],
    )
    d = net.run(
        net.decode_ns,
        *("sim-decode", "--port", "8200", "--vllm-d", "--version", VERSION, "--model", "m"),
        *("--max-model-len", "40"),
        log=logs[1],
    )
    stack.enter_context(running(p, logs[0], "sim-prefill", lambda: answers(p_url + "/health")))
    stack.enter_context(running(d, logs[1], "sim-decode", lambda: True))  # the sidecar's /readyz needs D
    return p_url


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
