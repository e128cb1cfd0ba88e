"""TODO docstring."""

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

import pytest

from tests.support.runner import answers
from tests.support.until import until

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
