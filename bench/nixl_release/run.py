"""Release latency and throughput of the ``nixl`` strategy against real NIXL agents on loopback.

P runs in a child process (the integration tests' ``FakePrefill``: real NIXL
agents, the side channel of one vLLM release) and stamps every notification
with ``time.monotonic_ns()`` (system-wide on Linux, so comparable with ours).
Latency is from ``release()`` being called to the last P rank holding the
notification: *warm* with the handshake cached, *cold* with the cache emptied
before each release (handshake + ``add_remote_agent`` + send). Throughput is
sustained releases/second with many releases in flight. Prints JSON.

    uv run python -m bench.nixl_release [--tp 1] [--version 0.33.0] [--seconds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

TARGETS = {"warm_p99_ms": 5.0, "cold_p99_ms": 50.0, "releases_per_s": 5000.0}


def serve_p(version: str, tp: int) -> None:
    """Child: P, reporting arrival times on ``dump``."""
    from tests.support.fake_p import FakePrefill

    p = FakePrefill(version, tp)
    arrivals: dict[str, list[int]] = {}
    lock = threading.Lock()
    print(json.dumps({"port": p.port, "engine_id": p.engine_id}), flush=True)

    def commands() -> None:
        for line in sys.stdin:
            if line.strip() == "dump":
                with lock:
                    data = {rid: [len(ts), max(ts)] for rid, ts in arrivals.items()}
                    arrivals.clear()
                print(json.dumps(data), flush=True)
            elif line.strip() == "quit":
                p.stop()
                os._exit(0)  # the poll loop runs on the main thread

    threading.Thread(target=commands, daemon=True).start()
    while True:
        time.sleep(0.0002)  # an engine step's cadence, not a busy loop: the machine has 2 cores
        for agent in p.agents.values():
            for messages in agent.get_new_notifs().values():
                now = time.monotonic_ns()
                with lock:
                    for message in messages:
                        arrivals.setdefault(message.decode().rsplit(":", 1)[0], []).append(now)


class P:
    def __init__(self, version: str, tp: int) -> None:
        command = [
            sys.executable,
            "-m",
            "bench.nixl_release",
            "--serve-p",
            "--version",
            version,
            "--tp",
            str(tp),
        ]
        self.proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        info = self._line()
        self.port, self.engine_id, self.tp = info["port"], info["engine_id"], tp

    def _line(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError("P exited")
            if line.startswith("{"):
                return dict(json.loads(line))

    def dump(self) -> dict[str, list[int]]:
        assert self.proc.stdin is not None
        self.proc.stdin.write("dump\n")
        self.proc.stdin.flush()
        return self._line()

    def collect(self, expected: set[str], timeout: float = 10.0) -> dict[str, int]:
        """Arrival time (ns) of the last rank for every id in ``expected``."""
        done: dict[str, int] = {}
        counts: dict[str, int] = {}
        deadline = time.monotonic() + timeout
        while set(done) != expected and time.monotonic() < deadline:
            for rid, (count, last) in self.dump().items():
                counts[rid] = counts.get(rid, 0) + count
                if counts[rid] >= self.tp:
                    done[rid] = max(done.get(rid, 0), last)
            time.sleep(0.01)
        missing = expected - set(done)
        if missing:
            raise RuntimeError(f"{len(missing)} releases never reached every rank")
        return done

    def stop(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("quit\n")
        self.proc.stdin.flush()
        self.proc.wait(10)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def run(version: str, tp: int, seconds: float, cold_n: int, warm_n: int) -> dict[str, Any]:
    from prometheus_client import CollectorRegistry

    from sidecar.config import Config
    from sidecar.release.base import JobResult
    from sidecar.release.nixl import NixlReleaser
    from tests.support.fake_p import make_job, params_for

    p = await asyncio.to_thread(P, version, tp)

    async def no_version() -> str | None:
        return None

    cfg = Config(vllm_version=version, prefill_allow=("127.0.0.1/32",))
    releaser = NixlReleaser(cfg, no_version, CollectorRegistry())
    await releaser.start()
    logger_level = __import__("logging").getLogger("sidecar.release.nixl")
    logger_level.setLevel("ERROR")  # the loopback warning is expected here

    def job(rid: str) -> Any:
        return make_job(params_for(version, p.engine_id, p.port, rid, tp=tp), rid)

    calls: dict[str, list[float]] = {"cold": [], "warm": []}

    async def timed(kind: str, rids: list[str], before_each: Any = None) -> list[float]:
        submitted: dict[str, int] = {}
        for rid in rids:
            if before_each is not None:
                await before_each()
            submitted[rid] = time.monotonic_ns()
            assert await releaser.release(job(rid)) is JobResult.SENT
            calls[kind].append((time.monotonic_ns() - submitted[rid]) / 1e6)  # the sidecar's part
            await asyncio.sleep(0.001)  # one at a time: latency, not queueing
        arrived = await asyncio.to_thread(p.collect, set(rids))
        return [(arrived[rid] - submitted[rid]) / 1e6 for rid in rids]

    async def empty_cache() -> None:
        await releaser.session.drop(releaser.session.cache.drain(), "bench")

    try:
        cold = await timed("cold", [f"cold-{i}" for i in range(cold_n)], empty_cache)
        warm = await timed("warm", [f"warm-{i}" for i in range(warm_n)])
        count, inflight, started = 0, 64, time.monotonic()
        rids: set[str] = set()

        async def worker(w: int) -> None:
            nonlocal count
            i = 0
            while time.monotonic() - started < seconds:
                rid = f"tput-{w}-{i}"
                i += 1
                rids.add(rid)
                assert await releaser.release(job(rid)) is JobResult.SENT
                count += 1

        await asyncio.gather(*(worker(w) for w in range(inflight)))
        elapsed = time.monotonic() - started
        await asyncio.to_thread(p.collect, rids, 30.0)  # every one reached every rank
    finally:
        await releaser.close()
        p.stop()
    result: dict[str, Any] = {
        "version": version,
        "tp": tp,
        "cold_p50_ms": round(statistics.median(cold), 3),
        "cold_p99_ms": round(percentile(cold, 0.99), 3),
        "warm_p50_ms": round(statistics.median(warm), 3),
        "warm_p99_ms": round(percentile(warm, 0.99), 3),
        "releases_per_s": round(count / elapsed),
        # release() alone (to the last send_notif returning), without NIXL's delivery to P:
        "cold_call_p50_ms": round(statistics.median(calls["cold"]), 3),
        "cold_call_p99_ms": round(percentile(calls["cold"], 0.99), 3),
        "warm_call_p50_ms": round(statistics.median(calls["warm"]), 3),
        "warm_call_p99_ms": round(percentile(calls["warm"], 0.99), 3),
    }
    result["vs_target"] = {
        "warm_p99": round(TARGETS["warm_p99_ms"] / result["warm_p99_ms"], 2),
        "cold_p99": round(TARGETS["cold_p99_ms"] / result["cold_p99_ms"], 2),
        "throughput": round(result["releases_per_s"] / TARGETS["releases_per_s"], 2),
    }  # > 1 means better than the target
    return result


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.nixl_release", description=__doc__.splitlines()[0])
    parser.add_argument("--version", default="0.34.0")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--cold", type=int, default=100)
    parser.add_argument("--warm", type=int, default=1000)
    parser.add_argument("--serve-p", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_p:
        serve_p(args.version, args.tp)
        return
    print(json.dumps(asyncio.run(run(args.version, args.tp, args.seconds, args.cold, args.warm)), indent=2))
