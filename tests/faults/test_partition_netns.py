"""A real network partition between the decode pod and P: P in its own network namespace.

P (the simulator, a child process) runs in a namespace joined to this one by
a veth pair; D and the sidecar stay here, so handshakes *and* NIXL's own UCX
traffic cross the veth. The partition takes P's end of the pair down while
this end keeps a permanent neighbour entry for P: packets to P are then
dropped silently (no RST, no ICMP), as a partition does; bringing the link up
heals it. ``tc netem`` or iptables would be the usual tools; this machine's
kernel has neither netem nor an iptables binary, the link trick needs only
``ip``. Needs root (CAP_NET_ADMIN); skipped, with the reason, when ``ip
netns`` is missing or not permitted. Slow (``make faults``).
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import httpx
import pytest

from sidecar.sim.decode import create_decode_app
from sidecar.sim.decode.config import DecodeSimConfig
from sidecar.sim.decode.nixl import VllmDHooks
from sidecar.sim.servers import serve
from tests.faults.cluster import MAX_MODEL_LEN, MODEL, TP, VERSION, Backends, scene
from tests.support.until import until

pytestmark = [pytest.mark.nixl, pytest.mark.slow_faults, pytest.mark.netns_first]

P_PORT = 18100


@dataclass
class Namespace:
    name: str
    here: str  # this end of the veth pair
    there: str  # P's end, inside the namespace
    p_address: str

    @property
    def url(self) -> str:
        return f"http://{self.p_address}:{P_PORT}"

    def partition(self) -> None:
        _ip("netns", "exec", self.name, "ip", "link", "set", self.there, "down")

    def heal(self) -> None:
        _ip("netns", "exec", self.name, "ip", "link", "set", self.there, "up")


def _ip(*args: str) -> None:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if result.returncode:
        raise RuntimeError(f"ip {' '.join(args)}: {result.stderr.strip()}")


@contextmanager
def namespace() -> Iterator[Namespace]:
    """A namespace with a veth pair to this one; skips (with the reason) when not permitted."""
    if shutil.which("ip") is None:
        pytest.skip("the ip tool (iproute2) is not installed: no network namespaces")
    tag = f"{os.getpid() % 10000}{random.randrange(100)}"
    subnet = f"10.213.{random.randrange(256)}"
    ns = Namespace(f"kvrf{tag}", f"kvrf{tag}a", f"kvrf{tag}b", f"{subnet}.2")
    try:
        _ip("netns", "add", ns.name)
    except RuntimeError as exc:
        pytest.skip(f"ip netns is not permitted here ({exc})")
    try:
        _ip("link", "add", ns.here, "type", "veth", "peer", "name", ns.there)
        _ip("link", "set", ns.there, "netns", ns.name)
        _ip("addr", "add", f"{subnet}.1/30", "dev", ns.here)
        _ip("link", "set", ns.here, "up")
        for args in (
            ("addr", "add", f"{subnet}.2/30", "dev", ns.there),
            ("link", "set", ns.there, "up"),
            ("link", "set", "lo", "up"),
        ):
            _ip("netns", "exec", ns.name, "ip", *args)
        mac = subprocess.run(
            ["ip", "netns", "exec", ns.name, "cat", f"/sys/class/net/{ns.there}/address"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        # A permanent neighbour: with P's end down, packets to P are dropped, never refused.
        _ip("neigh", "replace", ns.p_address, "lladdr", mac, "dev", ns.here, "nud", "permanent")
        yield ns
    finally:
        subprocess.run(["ip", "netns", "del", ns.name], capture_output=True, check=False)
        subprocess.run(["ip", "link", "del", ns.here], capture_output=True, check=False)


@contextmanager
def p_in(ns: Namespace) -> Iterator[Namespace]:
    command = [
        "ip",
        "netns",
        "exec",
        ns.name,
        sys.executable,
        "-m",
        "sidecar",
        "sim-prefill",
        "--host",
        ns.p_address,
        "--port",
        str(P_PORT),
        "--side-channel-host",
        ns.p_address,
        "--side-channel-port",
        "0",
        "--tp",
        str(TP),
        "--lease",
        "0",
        "--num-blocks",
        "4096",
        "--model",
        MODEL,
        "--vllm-version",
        VERSION,
        "--log-level",
        "warning",
    ]
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        until(lambda: _up(ns.url), "P in the namespace to answer", timeout=30, poll=0.05)
        yield ns
    finally:
        proc.terminate()
        proc.wait(15)


def _up(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=1).status_code == 200
    except httpx.TransportError:
        return False


def test_partition_between_sidecar_and_p_netns() -> None:
    """Partitions of the veth between the decode pod (D, sidecar) and P.

    1. Cold (no cached handshake), longer than the deadline (5 s): handshakes
       time out; the job fails; P keeps the blocks.
    2. Cold, healed within the deadline: released once after the heal.
    3. Warm (handshake cached) for 2 s: the notification is handed to UCX at
       once (``sent``) and crosses when the link heals (TCP retransmits); P
       frees it by notification, once.

    Expected for all: D's 400 at once; no wrong or double release; P unharmed
    (a fresh handshake across the veth works).
    """
    config = DecodeSimConfig(port=0, version=VERSION, model=MODEL, max_model_len=MAX_MODEL_LEN, vllm_d=True)
    with namespace() as ns, p_in(ns), serve(create_decode_app(config, VllmDHooks(VERSION))) as d:
        cluster = Backends(ns, d, None)
        with scene(cluster, d.url, "netns", prefill_allow=(f"{ns.p_address}/32",), release_deadline=5.0) as s:
            pins = [s.flows.pin() for _ in range(4)]  # P's HTTP side is behind the partition too
            ns.partition()
            # One job at a time into the silent P, so the deadline case is one job's alone.
            lost = s.flows.decode(s.sc.url, "reject", pinned=pins[0])
            until(
                lambda: s.sample("kvr_releases_total", strategy="nixl", result="failed") == 1, "deadline", 20
            )
            healed = [s.flows.decode(s.sc.url, "reject", pinned=pin) for pin in pins[1:3]]
            until(lambda: s.sample("kvr_nixl_errors_total", reason="handshake_timeout") >= 3, "timeouts")
            ns.heal()
            # The deadline leaves the healed jobs ~3 s after the heal: room for a loaded machine.
            until(lambda: s.sample("kvr_releases_total", strategy="nixl", result="sent") == 2, "heal", 20)
            ns.partition()
            began = time.monotonic()
            warm = s.flows.decode(s.sc.url, "reject", pinned=pins[3])
            until(lambda: s.sample("kvr_releases_total", strategy="nixl", result="sent") == 3, "warm send")
            handed_over = time.monotonic() - began  # P itself cannot be asked while partitioned
            ns.heal()
            rejected = [lost, *healed, warm]
            assert [x.status for x in rejected] == [400] * 4
            assert handed_over < 1.0
            s.check(
                [
                    s.observe(lost, "sidecar", reachable=False),
                    *(s.observe(x, "sidecar") for x in (*healed, warm)),
                ],
                timeout=30,
            )
