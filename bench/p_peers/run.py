"""What each sidecar NIXL agent connected to P costs P: memory, fds, threads, CPU per handshake and message.

With ``--workers N`` every sidecar worker is its own NIXL agent: it fetches
each P engine's metadata over P's side channel, adds it
(``add_remote_agent``) and sends its notifications itself. This bench plays
that against one real P agent on loopback (``bench.p_peers.procs``: P in its
own process, made as vLLM 0.33.0's connector makes it; each peer in its own
process, the sidecar's own ``NixlPeer`` and ``HandshakeClient``):

1. P starts, then every peer process, none connected yet; P is read idle.
2. One peer at a time handshakes and sends one notification; P's CPU during
   that step beyond its idle rate is the handshake's cost, and the peer times
   its fetch and its ``add_remote_agent``. After 1, 2, 4, 8, ... peers P is
   read idle again (RSS, fds, threads, idle CPU, the cost of one
   ``get_new_notifs()`` call).
3. With every peer connected, one agent sends a burst of notifications, then
   every agent sends its share of a burst as large; P's CPU per notification.

It runs once with P as vLLM makes it (NIXL's progress thread on) and once
with P driving UCX itself (no progress thread), where the progress work is
not hidden in a spinning thread's CPU. ``UCX_TLS`` is ``tcp`` unless
``--ucx-tls`` says otherwise (the sidecar and P are on different nodes;
loopback would otherwise use shared memory). Prints a table; raw figures in
JSON.

    uv run python -m bench.p_peers [--quick] [--peers 1,2,4,8,16] [--json PATH]
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from bench.harness.main import bench_parser, progress
from bench.harness.procs import BenchError
from bench.harness.report import write_json
from bench.p_peers.report import (
    Handshake,
    Idle,
    Notifications,
    PState,
    Report,
    Run,
    extra_cpu,
    idle,
    per_peer,
    read_p,
    render,
)

DEFAULT_JSON = Path("out/bench-p-peers.json")
START_TIMEOUT = 180.0  # seconds for every peer to be up: each imports NIXL, on two busy cores
STEP_TIMEOUT = 60.0


@dataclass(frozen=True, slots=True)
class Settings:
    peers: tuple[int, ...]  # readings after this many agents connected
    notifications: int  # per agent in the burst from every agent
    idle_seconds: float
    progress: tuple[str, ...]  # P configurations: "thread", "poll"
    ucx_tls: str  # "" leaves UCX_TLS to UCX
    poll_ms: float = 1.0


class LineChild:
    """A ``bench.p_peers.procs`` child: a JSON line out for each JSON line in."""

    def __init__(self, args: list[str], env: dict[str, str], log: IO[bytes]) -> None:
        argv = [sys.executable, "-m", "bench.p_peers.procs", *args]
        self.process = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, env=env, text=True
        )
        self.name = args[0]
        self.ready: dict[str, Any] = {}  # its first line

    def wait_ready(self, timeout: float) -> None:
        self.ready = self.read(timeout)

    def send(self, message: dict[str, Any]) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(message) + "\n")
        self.process.stdin.flush()

    def read(self, timeout: float) -> dict[str, Any]:
        stdout = self.process.stdout
        assert stdout is not None
        ready, _, _ = select.select([stdout], [], [], timeout)
        line = stdout.readline() if ready else ""
        if not line:
            raise BenchError(f"{self.name} (pid {self.process.pid}) gave no answer in {timeout:.0f} s")
        answer: dict[str, Any] = json.loads(line)
        return answer

    def ask(self, message: dict[str, Any], timeout: float = STEP_TIMEOUT) -> dict[str, Any]:
        self.send(message)
        return self.read(timeout)

    def stop(self) -> None:
        if self.process.poll() is None:
            try:
                self.send({"cmd": "stop"})
                self.process.wait(20)
            except (OSError, subprocess.TimeoutExpired):
                self.process.kill()
                self.process.wait()


@contextmanager
def children(settings: Settings, progress_mode: str, count: int, log: IO[bytes]) -> Iterator[list[LineChild]]:
    """P (first) and ``count`` peers, all ready; stopped on the way out."""
    env = dict(os.environ)
    if settings.ucx_tls:
        env["UCX_TLS"] = settings.ucx_tls
    started: list[LineChild] = []
    try:
        p_args = ["p", "--progress", progress_mode, "--poll-ms", str(settings.poll_ms)]
        started.append(LineChild(p_args, env, log))
        started += [LineChild(["peer"], env, log) for _ in range(count)]
        for child in started:
            child.wait_ready(START_TIMEOUT)
        yield started
    finally:
        for child in reversed(started):
            child.stop()


class Probe:
    """Readings of P: its ``/proc`` and its own counters."""

    def __init__(self, p: LineChild) -> None:
        ready = p.ready
        self.p, self.pid, self.port = p, int(ready["pid"]), int(ready["port"])
        self.own = frozenset(int(tid) for tid in ready["own_tids"])
        self.metadata_bytes = int(ready["metadata_bytes"])

    def state(self) -> PState:
        return read_p(self.pid, self.own, time.monotonic())

    def mark(self) -> tuple[int, PState]:
        """P's drain iterations so far, then its state: the start of a step."""
        return int(self.counters()["polls"]), self.state()

    def wait(self, count: int) -> tuple[int, int, PState]:
        """Until P holds ``count`` notifications in all: how many it holds, its drain iterations so
        far, its state."""
        held = self.p.ask({"cmd": "wait", "count": count, "timeout": STEP_TIMEOUT})
        return int(held["received"]), int(held["polls"]), self.state()

    def counters(self) -> dict[str, Any]:
        return self.p.ask({"cmd": "stats"})

    def idle(self, peers: int, seconds: float) -> Idle:
        time.sleep(min(seconds, 0.5))  # what the last step started settles
        counted, before = self.counters(), self.state()
        time.sleep(seconds)
        after, later = self.state(), self.counters()
        polls = later["polls"] - counted["polls"]
        return idle(peers, before, after, polls, later["poll_cpu_s"] - counted["poll_cpu_s"])


def handshake(probe: Probe, peer: LineChild, index: int, rates: Idle) -> Handshake:
    """Peer ``index`` (1-based) connects and sends one notification; P's cost beyond idle."""
    polls, before = probe.mark()
    sent = time.monotonic()
    timed = peer.ask({"cmd": "handshake", "port": probe.port})
    first = peer.ask({"cmd": "notify", "count": 1, "prefix": f"hello-{index}"})
    if first["sent"] != 1:
        raise BenchError(f"peer {index}: its first notification failed: {first['errors']}")
    got, polled, after = probe.wait(index)
    connected = after.at
    if got != index:
        raise BenchError(f"P holds {got} notifications after {index} handshakes")
    own, nixl = extra_cpu(before, after, polled - polls, rates)
    return Handshake(
        peer=index,
        fetch_ms=timed["fetch_ms"],
        add_ms=timed["add_ms"],
        connect_ms=(connected - sent) * 1e3,
        own_cpu_ms=own * 1e3,
        nixl_cpu_ms=nixl * 1e3,
    )


def burst(probe: Probe, senders: list[LineChild], each: int, expected: int, rates: Idle) -> Notifications:
    """Every one of ``senders`` sends ``each`` notifications at once; P drains them all."""
    polls, before = probe.mark()
    started = time.monotonic()
    for index, peer in enumerate(senders):
        peer.send({"cmd": "notify", "count": each, "prefix": f"burst-{expected}-{index}"})
    answers = [peer.read(STEP_TIMEOUT) for peer in senders]
    got, polled, after = probe.wait(expected)
    ended = after.at
    total = each * len(senders)
    if sum(a["sent"] for a in answers) != total or got != expected:
        errors = [e for a in answers for e in a["errors"]][:3]
        raise BenchError(f"P holds {got} of {expected} notifications; send errors: {errors}")
    own, nixl = extra_cpu(before, after, polled - polls, rates)
    return Notifications(
        agents=len(senders),
        notifications=total,
        received=total,
        wall_ms=(ended - started) * 1e3,
        own_cpu_us=own / total * 1e6,
        nixl_cpu_us=nixl / total * 1e6,
    )


def run_one(settings: Settings, progress_mode: str, log: IO[bytes]) -> Run:
    """Every step with one P configuration."""
    most = max(settings.peers)
    with children(settings, progress_mode, most, log) as started:
        probe, peers = Probe(started[0]), started[1:]
        progress(f"p-peers ({progress_mode}): P and {most} peers up; P idle with none connected")
        readings = [probe.idle(0, settings.idle_seconds)]
        steps = []
        for index, peer in enumerate(peers, start=1):
            steps.append(handshake(probe, peer, index, readings[-1]))
            if index in settings.peers:
                readings.append(probe.idle(index, settings.idle_seconds))
                progress(f"p-peers ({progress_mode}): {index} connected, P at {readings[-1].rss_mb:.1f} MB")
        received = most
        bursts = []
        for senders in ([peers[0]], peers):
            each = settings.notifications * most // len(senders)
            received += each * len(senders)
            bursts.append(burst(probe, senders, each, received, readings[-1]))
        served = probe.counters()
        if served["served"] != most or served["senders"] != most:
            raise BenchError(f"P served {served['served']} handshakes, heard from {served['senders']} agents")
    return Run(
        progress=progress_mode,
        metadata_bytes=probe.metadata_bytes,
        handshakes_served=served["served"],
        idle=readings,
        handshakes=steps,
        notifications=bursts,
        per_peer=per_peer(readings, steps),
    )


def loadavg() -> list[float]:
    return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]


def run(settings: Settings) -> Report:
    before = loadavg()
    with tempfile.TemporaryDirectory(prefix="kvr-bench-p-peers-") as scratch:
        path = Path(scratch) / "children.log"
        try:
            with path.open("wb") as log:
                runs = [run_one(settings, mode, log) for mode in settings.progress]
        except BenchError as exc:
            tail = path.read_text(errors="replace").splitlines()[-20:]
            raise BenchError(f"{exc}\n" + "\n".join(tail)) from exc
    return Report(
        settings={
            "peers": list(settings.peers),
            "notifications_per_agent": settings.notifications,
            "idle_seconds": settings.idle_seconds,
            "ucx_tls": settings.ucx_tls or "(UCX's choice)",
            "poll_ms": settings.poll_ms,
            "cpus": os.cpu_count(),
        },
        load_before=before,
        load_after=loadavg(),
        runs=runs,
    )


def settings_from(argv: Sequence[str] | None) -> tuple[Settings, Path]:
    parser = bench_parser(
        "bench.p_peers", __doc__, DEFAULT_JSON, "1 and 2 peers, short idle windows", "raw figures"
    )
    parser.add_argument("--peers", help="readings after this many agents connected (default 1,2,4,8,16)")
    parser.add_argument("--notifications", type=int, help="per agent in the bursts (default 200)")
    parser.add_argument("--progress", default="thread,poll", help="P configurations: thread, poll, or both")
    parser.add_argument("--ucx-tls", default="tcp", help="UCX_TLS for P and the peers ('' for UCX's choice)")
    args = parser.parse_args(argv)
    peers = args.peers or ("1,2" if args.quick else "1,2,4,8,16")
    try:
        counts = tuple(sorted({int(x) for x in peers.split(",")}))
    except ValueError:
        parser.error(f"--peers {peers}: not a list of numbers")
    modes = tuple(m for m in args.progress.split(",") if m)
    if not counts or counts[0] < 1 or not modes or set(modes) - {"thread", "poll"}:
        parser.error("--peers needs counts of 1 or more; --progress takes thread and/or poll")
    notifications = args.notifications or (20 if args.quick else 200)
    idle_seconds = 0.5 if args.quick else 2.0
    return Settings(counts, notifications, idle_seconds, modes, args.ucx_tls), args.json


def main(argv: Sequence[str] | None = None) -> int:
    settings, json_path = settings_from(argv)
    try:
        report = run(settings)
    except BenchError as exc:
        print(f"bench.p_peers: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    write_json(report, json_path)
    print(render(report))
    print(f"raw figures: {json_path}")
    return 0
