"""``python -m tests.faults.soak``: a bounded soak of the sidecar through the simulators, with faults.

Starts P (``sim-prefill``, vLLM 0.34.0, TP 2, pins that never expire), "vLLM D"
(``sim-decode --vllm-d``) and the sidecar (``tests.faults.sidecar_proc``: the
production ``serve`` plus a debug port, release ``nixl``) as child processes,
then sends P->D flows in rounds (``--round``, 32 in flight) until
``--requests`` flows or ``--duration`` seconds, whichever comes first. About
``--rejections`` of the decode legs are rejected for realistic reasons
(request validation before D's handler: the sidecar's to release; prompt
too long in D's handler: D's own fix; an error event opening a stream: the
sidecar's). Faults are drawn at random per round: P re-registers its NIXL
agents (``/sim/restart-agents``, at a random point of the round, after the
flows then in flight ended and P holds nothing, so no notification is still
on its way to the agents being replaced), D slow to send
headers (past the sidecar's ``header_timeout``: 504), D cutting streams, and
clients leaving while D still works.

After each round the invariant checker (``tests.faults.invariants``) judges
every flow of the round from the simulators' records, and the sidecar's RSS
(``/proc``) and asyncio tasks (debug port) are sampled. The run writes
``report.json`` (settings, one record per round, the RSS series, the
verdict) under ``--out`` and prints a short table; the exit code is 0 only
when no invariant was violated and memory stayed flat after the warm-up.
The sidecar runs with ``--ledger-size`` 4096 (``--ledger-size`` here), so its
bounded structures fill early and a flat RSS afterwards is meaningful.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import httpx

from sidecar.loadtest.workload import VOCABULARY
from tests.faults.cluster import MAX_MODEL_LEN, MODEL, TP, VERSION
from tests.faults.evidence import Bounds, ProcessView
from tests.faults.invariants import Fate, InvariantChecker, Observed, Truth
from tests.support.ports import free_port
from tests.support.until import until

PAGE = 4096
KINDS: dict[str, Fate | None] = {  # kind -> the fate its design implies (None: derived only)
    "admit": "d",
    "stream": "d",
    "reject": "sidecar",  # request validation, before D's handler
    "reject_handler": "d",  # prompt over max_model_len, in D's handler: D's own fix (0.21.0+)
    "stream_error": "sidecar",  # 200, then a 400 error event: engine admission failed
    "slow": "d",  # fault: D past header_timeout (504); the sidecar's abort cancels D's handler
    "drop": "d",  # fault: D cuts an admitted stream
    "disconnect": "d",  # fault: the client leaves while D's handler waits
}


@dataclass(frozen=True)
class SoakConfig:
    requests: int
    duration: float
    round_size: int
    concurrency: int
    rejections: float
    faults: float  # largest share of fault flows in a round (each round draws its own share)
    p_restart: float  # chance that P re-registers its agents during a round
    header_timeout: float
    ledger_size: int
    seed: int
    out: str


@dataclass
class Flow:
    index: int
    request_id: str
    kind: str
    p_request_id: str = ""
    status: int = 0
    sidecar_answered: bool = False


@dataclass
class RoundRecord:
    index: int
    flows: int
    seconds: float
    flows_per_second: float
    kinds: dict[str, int]
    statuses: dict[str, int]
    p_restarts: int
    fates: dict[str, int]
    decisions: dict[str, int]
    p_delta: dict[str, int]
    violations: list[str]  # the first 20
    violation_count: int
    sidecar_rss_kib: int
    sidecar_tasks: int
    cumulative: int = 0
    restart_at: int | None = None  # the flow of the round before which P re-registered its agents
    internals: dict[str, int] = field(default_factory=dict)


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


@contextmanager
def child(command: list[str], log: Path, ready_url: str) -> Iterator[subprocess.Popen[bytes]]:
    with log.open("wb") as err:
        proc = subprocess.Popen(
            command, stdout=subprocess.DEVNULL, stderr=err, env={**os.environ, "PYTHONUNBUFFERED": "1"}
        )
    try:
        until(
            lambda: proc.poll() is None and _answers(ready_url),
            f"{command[2:4]} to start",
            60,
            0.05,
            state=lambda: log.read_text(errors="replace")[-2000:],
        )
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.TransportError:
        return False


@dataclass
class Cluster:
    p_url: str
    d_url: str
    sidecar_url: str
    view: ProcessView
    sidecar_pid: int


@contextmanager
def cluster(config: SoakConfig, workdir: Path) -> Iterator[Cluster]:
    py = sys.executable
    p_port, d_port, s_port, a_port, g_port = (free_port() for _ in range(5))
    p_url, d_url = f"http://127.0.0.1:{p_port}", f"http://127.0.0.1:{d_port}"
    s_url, a_url, g_url = (f"http://127.0.0.1:{port}" for port in (s_port, a_port, g_port))
    p_cmd = [
        py,
        "-m",
        "sidecar",
        "sim-prefill",
        "--port",
        str(p_port),
        "--tp",
        str(TP),
        "--lease",
        "0",
        "--num-blocks",
        "16384",
        "--side-channel-port",
        "0",
        "--model",
        MODEL,
        "--vllm-version",
        VERSION,
        "--log-level",
        "error",
    ]
    d_cmd = [
        py,
        "-m",
        "sidecar",
        "sim-decode",
        "--port",
        str(d_port),
        "--vllm-d",
        "--version",
        VERSION,
        "--model",
        MODEL,
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--log-size",
        "100000",
    ]
    s_cmd = [
        py,
        "-m",
        "tests.faults.sidecar_proc",
        "--debug-port",
        str(g_port),
        "--decode-url",
        d_url,
        "--host",
        "127.0.0.1",
        "--port",
        str(s_port),
        "--admin-host",
        "127.0.0.1",
        "--admin-port",
        str(a_port),
        "--release",
        "nixl",
        "--vllm-version",
        VERSION,
        "--prefill-allow",
        "127.0.0.1",
        "--header-timeout",
        str(config.header_timeout),
        "--ledger-size",
        str(config.ledger_size),
        "--log-format",
        "json",
        "--log-level",
        "info",
    ]
    with ExitStack() as stack:
        stack.enter_context(child(p_cmd, workdir / "p.log", p_url + "/health"))
        stack.enter_context(child(d_cmd, workdir / "d.log", d_url + "/health"))
        sidecar = stack.enter_context(child(s_cmd, workdir / "sidecar.log", a_url + "/readyz"))
        bounds = Bounds(
            queue=4096, ledger=config.ledger_size, engines=256, release_ambiguous=False, release_deadline=30.0
        )
        view = ProcessView(a_url, g_url, workdir / "sidecar.log", bounds)
        yield Cluster(p_url, d_url, s_url, view, sidecar.pid)


class Traffic:
    """Draws and runs the flows of one round (aiohttp, ``concurrency`` in flight)."""

    def __init__(self, config: SoakConfig, cluster: Cluster, session: aiohttp.ClientSession) -> None:
        self.config, self.cluster, self.session = config, cluster, session
        self.rng = random.Random(config.seed)
        self.run_id = f"soak{config.seed}-{os.getpid()}"

    def kinds(self, count: int) -> list[str]:
        """The round's mix: ``rejections`` rejected, a random share of faults, the rest admitted."""
        faults = self.rng.uniform(0, self.config.faults)
        weights = {
            "admit": 0.7 * (1 - self.config.rejections - faults),
            "stream": 0.3 * (1 - self.config.rejections - faults),
            "reject": 0.6 * self.config.rejections,
            "reject_handler": 0.2 * self.config.rejections,
            "stream_error": 0.2 * self.config.rejections,
            "slow": faults / 3,
            "drop": faults / 3,
            "disconnect": faults / 3,
        }
        return self.rng.choices(list(weights), list(weights.values()), k=count)

    async def round(self, first: int, kinds: list[str], restart_at: int | None) -> tuple[list[Flow], int]:
        gate = asyncio.Semaphore(self.config.concurrency)
        tasks: set[asyncio.Task[None]] = set()
        flows: list[Flow] = []
        restarts = 0
        for offset, kind in enumerate(kinds):
            if offset == restart_at:
                if tasks:
                    await asyncio.wait(tasks)  # the flows in flight end first: D's releases stay sound
                await self._quiet_p()
                async with self.session.post(self.cluster.p_url + "/sim/restart-agents") as response:
                    restarts += response.status == 200
            await gate.acquire()
            flow = Flow(first + offset, f"{self.run_id}-{first + offset:07d}", kind)
            flows.append(flow)
            task = asyncio.create_task(self._flow(flow, gate))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        if tasks:
            await asyncio.wait(tasks)
        return flows, restarts

    async def _quiet_p(self, bound: float = 10.0) -> None:
        """Until P frees nothing more: the notifications sent so far reached the agents being replaced.

        A notification still on its way when P drops its agents is lost with them (a real P
        re-registering loses it too); without this wait the soak would blame D's releases for it.
        Quiet means P holds nothing, or its frees stood still for 0.2 s (a request no one may free,
        ``unseen`` in the checker, stays pinned). Past ``bound`` seconds the restart goes ahead and
        the checker reports what stayed pinned.
        """
        deadline = time.monotonic() + bound
        last: tuple[int, int] | None = None
        still_since = time.monotonic()
        while time.monotonic() < deadline:
            async with self.session.get(self.cluster.p_url + "/stats") as response:
                stats = await response.json()
            now = (stats["pinned_requests"], stats["freed_by_notification"])
            if now[0] == 0:
                return
            if now != last:
                last, still_since = now, time.monotonic()
            elif time.monotonic() - still_since >= 0.2:
                return
            await asyncio.sleep(0.01)  # polling P, bounded by the deadline above

    async def _flow(self, flow: Flow, gate: asyncio.Semaphore) -> None:
        try:
            params = await self._prefill(flow)
            if params is not None:
                await self._decode(flow, params)
        finally:
            gate.release()

    async def _prefill(self, flow: Flow) -> dict[str, Any] | None:
        body = {
            "model": MODEL,
            "prompt": _prompt(flow),
            "max_tokens": 1,
            "stream": False,
            "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False},
        }
        headers = {"x-request-id": flow.request_id}
        async with self.session.post(self.cluster.p_url + "/v1/completions", json=body, headers=headers) as r:
            data = await r.json()
        params: dict[str, Any] = data["kv_transfer_params"]
        flow.p_request_id = params["remote_request_id"]
        return params

    async def _decode(self, flow: Flow, params: dict[str, Any]) -> None:
        kind = flow.kind
        body: dict[str, Any] = {
            "model": MODEL,
            "prompt": _prompt(flow),
            "max_tokens": 4,
            "kv_transfer_params": params,
        }
        if kind in ("stream", "stream_error", "drop"):
            body["stream"] = True
        body["prompt"] += {
            "stream_error": " [[stream-error:400]]",
            "drop": " [[drop-mid-stream]]",
            "slow": " [[slow-headers:1.0]]",
            "disconnect": " [[slow-headers:0.5]]",
        }.get(kind, "")
        if kind == "reject":
            body["max_tokens"] = "x"
        # A leaving client gives up 0.15 s after its request was written (not counting the wait for
        # a connection), so the sidecar has it: D, still in its handler, sees the abort.
        timeout = aiohttp.ClientTimeout(sock_read=0.15) if kind == "disconnect" else aiohttp.ClientTimeout(60)
        headers = {"x-request-id": flow.request_id}
        try:
            async with self.session.post(
                self.cluster.sidecar_url + "/v1/completions", json=body, headers=headers, timeout=timeout
            ) as response:
                flow.status = response.status
                data = await response.read()
                flow.sidecar_answered = response.status >= 400 and b"decode server" in data
        except (TimeoutError, aiohttp.ClientError):
            pass  # the client left (disconnect), or D cut the stream (drop): the status, if any, is kept


def _prompt(flow: Flow) -> str:
    """1-30 words (one block or two on P); over D's max_model_len for ``reject_handler``."""
    words = MAX_MODEL_LEN * 2 if flow.kind == "reject_handler" else 1 + flow.index % 30
    return " ".join(VOCABULARY[(flow.index + i) % len(VOCABULARY)] for i in range(words))


def observe(flow: Flow) -> Observed:
    return Observed(flow.request_id, flow.p_request_id, flow.status, flow.sidecar_answered, KINDS[flow.kind])


def memory_verdict(rounds: list[RoundRecord]) -> dict[str, Any]:
    """Flat when the median RSS of the last half exceeds that just after the warm-up by at most
    8 MiB + 5 %; the warm-up is the first fifth of the rounds (at least two)."""
    series = [r.sidecar_rss_kib for r in rounds]
    if len(series) < 4:
        return {"flat": True, "note": "too few rounds to judge", "series_kib": series}
    warm = max(2, len(series) // 5)
    base = statistics.median(series[warm : warm + max(1, (len(series) - warm) // 4)])
    late = statistics.median(series[len(series) // 2 :])
    allowed = 8 * 1024 + 0.05 * base
    return {
        "flat": late - base <= allowed,
        "after_warmup_kib": base,
        "last_half_median_kib": late,
        "growth_kib": late - base,
        "allowed_kib": round(allowed),
        "warmup_rounds": warm,
    }


def judge_round(
    checker: InvariantChecker,
    cluster: Cluster,
    flows: list[Flow],
    kinds: list[str],
    seconds: float,
    index: int,
) -> RoundRecord:
    """The invariant check of one round, then the sidecar's RSS, tasks and internals (blocking)."""
    report = checker.check([observe(f) for f in flows], timeout=60.0)
    tasks, _ = cluster.view.tasks()
    record = RoundRecord(
        index=index,
        flows=len(flows),
        seconds=round(seconds, 2),
        flows_per_second=round(len(flows) / seconds, 1),
        kinds=dict(Counter(kinds)),
        statuses=dict(Counter(str(f.status) for f in flows)),
        p_restarts=0,
        fates=report.fates,
        decisions=report.decisions,
        p_delta=report.p_delta,
        violations=report.violations[:20],
        violation_count=len(report.violations),
        sidecar_rss_kib=rss_kib(cluster.sidecar_pid),
        sidecar_tasks=tasks,
        internals=cluster.view.internals(),
    )
    httpx.post(cluster.d_url + "/sim/reset")  # D's log holds one round at a time
    return record


async def run(config: SoakConfig, cluster: Cluster, log: Any) -> dict[str, Any]:
    truth = Truth(cluster.p_url, cluster.d_url, VERSION)
    checker = InvariantChecker(truth, cluster.view, ranks=TP)
    rounds: list[RoundRecord] = []
    started = time.monotonic()
    sent = 0
    # Pooled connections are dropped after 1 s idle, well before the servers' 5 s keep-alive
    # timeout: reusing one the server is closing fails the request ("Server disconnected"),
    # which the soak would misread as a fault of the sidecar (idle gaps come while a round is judged).
    connector = aiohttp.TCPConnector(limit=config.concurrency * 2, keepalive_timeout=1.0)
    async with aiohttp.ClientSession(connector=connector, trust_env=False) as session:
        traffic = Traffic(config, cluster, session)
        while sent < config.requests and time.monotonic() - started < config.duration:
            count = min(config.round_size, config.requests - sent)
            kinds = traffic.kinds(count)
            restart_at = traffic.rng.randrange(count) if traffic.rng.random() < config.p_restart else None
            await asyncio.to_thread(checker.begin)
            began = time.monotonic()
            flows, restarts = await traffic.round(sent, kinds, restart_at)
            seconds = time.monotonic() - began
            record = await asyncio.to_thread(
                judge_round, checker, cluster, flows, kinds, seconds, len(rounds)
            )
            sent += len(flows)
            record.cumulative, record.p_restarts, record.restart_at = sent, restarts, restart_at
            rounds.append(record)
            print(
                f"round {record.index:3d}: {sent:7d} flows, {record.flows_per_second:6.1f}/s, "
                f"rss {record.sidecar_rss_kib / 1024:6.1f} MiB, tasks {record.sidecar_tasks}, "
                f"restarts {restarts}, violations {record.violation_count}",
                file=log,
                flush=True,
            )
    truth.close()
    return summarize(config, rounds, time.monotonic() - started)


def summarize(config: SoakConfig, rounds: list[RoundRecord], elapsed: float) -> dict[str, Any]:
    totals: dict[str, Counter[str]] = {
        k: Counter() for k in ("kinds", "statuses", "fates", "decisions", "p_delta")
    }
    for record in rounds:
        for key, counter in totals.items():
            counter.update(getattr(record, key))
    violations = sum(r.violation_count for r in rounds)
    memory = memory_verdict(rounds)
    return {
        "config": asdict(config),
        "elapsed_seconds": round(elapsed, 1),
        "flows": sum(r.flows for r in rounds),
        "rounds": len(rounds),
        "p_restarts": sum(r.p_restarts for r in rounds),
        "totals": {key: dict(counter) for key, counter in totals.items()},
        "violations": violations,
        "memory": memory,
        "tasks": sorted({r.sidecar_tasks for r in rounds}),
        "verdict": "PASS" if violations == 0 and memory["flat"] else "FAIL",
        "round_records": [asdict(r) for r in rounds],
    }


def table(report: dict[str, Any]) -> str:
    rounds = report["round_records"]
    picks = sorted({0, len(rounds) // 4, len(rounds) // 2, 3 * len(rounds) // 4, len(rounds) - 1})
    lines = [
        f"soak: {report['flows']} flows in {report['rounds']} rounds, {report['elapsed_seconds']} s, "
        f"{report['p_restarts']} P restarts",
        f"kinds: {report['totals']['kinds']}",
        f"client statuses: {report['totals']['statuses']}",
        f"fates (who frees P): {report['totals']['fates']}",
        f"sidecar release decisions: {report['totals']['decisions']}",
        f"P deltas: {report['totals']['p_delta']}",
        "",
        "round   flows  flows/s  sidecar RSS MiB  tasks",
    ]
    for i in picks:
        r = rounds[i]
        lines.append(
            f"{r['index']:5d} {r['cumulative']:7d}  {r['flows_per_second']:7.1f}  "
            f"{r['sidecar_rss_kib'] / 1024:15.1f}  {r['sidecar_tasks']:5d}"
        )
    memory = report["memory"]
    lines += [
        "",
        f"memory: {json.dumps(memory)}",
        f"invariant violations: {report['violations']}",
        f"verdict: {report['verdict']}",
    ]
    return "\n".join(lines)


def parse(argv: list[str]) -> SoakConfig:
    parser = argparse.ArgumentParser(prog="python -m tests.faults.soak", description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=200_000, help="flows in all (default 200000)")
    parser.add_argument("--duration", type=float, default=1500.0, help="stop after this many seconds")
    parser.add_argument(
        "--round", dest="round_size", type=int, default=2000, help="flows per round (<= 4000)"
    )
    parser.add_argument("--concurrency", type=int, default=32, help="flows in flight")
    parser.add_argument("--rejections", type=float, default=0.10, help="share of rejected decode legs")
    parser.add_argument("--faults", type=float, default=0.06, help="largest share of fault flows per round")
    parser.add_argument("--p-restart", type=float, default=0.3, help="chance of a P restart per round")
    parser.add_argument("--header-timeout", type=float, default=0.5, help="the sidecar's header_timeout")
    parser.add_argument("--ledger-size", type=int, default=4096, help="the sidecar's ledger_size")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", default="out/soak", help="directory of report.json (default out/soak)")
    args = parser.parse_args(argv)
    if not 1 <= args.round_size <= 4000:  # P remembers its last 4096 finished requests
        parser.error("--round must be between 1 and 4000")
    return SoakConfig(**vars(args))


def main(argv: list[str]) -> int:
    config = parse(argv)
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="kvr-soak-") as tmp, cluster(config, Path(tmp)) as started:
        report = asyncio.run(run(config, started, sys.stderr))
    (out / "report.json").write_text(json.dumps(report, indent=2))
    print(table(report))
    print(f"report: {out / 'report.json'}")
    return 0 if report["verdict"] == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
