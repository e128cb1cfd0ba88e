"""The figures of ``bench.p_peers``: P's ``/proc`` readings, per-peer costs, the table.

CPU is read per thread (``/proc/<pid>/task/<tid>/schedstat``, nanoseconds:
the utime and stime of ``/proc/<pid>/stat`` count 10 ms ticks, too coarse for
one handshake) and split in two: P's own threads (the main thread, the
side-channel listener, the drain that calls ``get_new_notifs()``, ZMQ's) and
the threads NIXL started (its progress thread and UCX's). A step's CPU is
what each group spent during it less what it spends idle: for P's own
threads, the idle CPU per drain iteration times the iterations the step had
(a loaded machine stretches a step's wall time, not its polls); for NIXL's,
the idle rate times the step's wall time. With the progress thread on, NIXL's
threads spin a core whatever happens, so their share of a step is not
separable from the spin, and the table says so.
"""

from __future__ import annotations

import os
import statistics
from pathlib import Path

import msgspec


class PState(msgspec.Struct, kw_only=True):
    """One reading of P: memory, fds, threads, CPU seconds by group, and when."""

    at: float  # time.monotonic()
    rss_kb: int
    fds: int
    threads: int
    own_cpu_s: float
    nixl_cpu_s: float


def read_p(pid: int, own_tids: frozenset[int], at: float) -> PState:
    """P's state now: VmRSS and Threads from status, the fd count, CPU of each thread group."""
    status = dict(
        line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line
    )
    own = nixl = 0.0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:  # nanoseconds on a CPU: utime + stime in /proc/<pid>/stat count 10 ms ticks
            seconds = int((task / "schedstat").read_text().split()[0]) / 1e9
        except OSError:  # the thread just ended
            continue
        if int(task.name) in own_tids:
            own += seconds
        else:
            nixl += seconds
    return PState(
        at=at,
        rss_kb=int(status["VmRSS"].split()[0]),
        fds=len(os.listdir(f"/proc/{pid}/fd")),
        threads=int(status["Threads"]),
        own_cpu_s=own,
        nixl_cpu_s=nixl,
    )


class Idle(msgspec.Struct, kw_only=True):
    """P with ``peers`` agents connected, nothing happening, over a window of ``seconds``."""

    peers: int
    seconds: float
    rss_mb: float
    fds: int
    threads: int
    own_cores: float  # CPU rate of P's own threads (the drain's polling, mostly)
    nixl_cores: float  # of NIXL's threads (its progress thread's spin, when on)
    poll_us: float  # thread CPU of one get_new_notifs() call, on average
    own_per_poll_us: float  # CPU of P's own threads per drain iteration (the call, the loop, the rest)


def idle(peers: int, before: PState, after: PState, polls: int, poll_cpu_s: float) -> Idle:
    wall = after.at - before.at
    own = after.own_cpu_s - before.own_cpu_s
    return Idle(
        peers=peers,
        seconds=wall,
        rss_mb=after.rss_kb / 1024,
        fds=after.fds,
        threads=after.threads,
        own_cores=own / wall,
        nixl_cores=(after.nixl_cpu_s - before.nixl_cpu_s) / wall,
        poll_us=poll_cpu_s / polls * 1e6 if polls else 0.0,
        own_per_poll_us=own / polls * 1e6 if polls else 0.0,
    )


def extra_cpu(before: PState, after: PState, polls: int, rates: Idle) -> tuple[float, float]:
    """CPU seconds (own, NIXL's) spent between two readings ``polls`` drain iterations apart,
    beyond what idle costs."""
    wall = after.at - before.at
    own = after.own_cpu_s - before.own_cpu_s - rates.own_per_poll_us / 1e6 * polls
    nixl = after.nixl_cpu_s - before.nixl_cpu_s - rates.nixl_cores * wall
    return own, nixl


class Handshake(msgspec.Struct, kw_only=True):
    """One more peer connecting: its side (fetch, add) and P's (CPU beyond idle)."""

    peer: int  # 1 for the first agent to connect
    fetch_ms: float  # the side-channel round trip (HandshakeClient.fetch)
    add_ms: float  # add_remote_agent
    connect_ms: float  # from asking for the handshake to P holding the peer's first notification
    own_cpu_ms: float
    nixl_cpu_ms: float


class Notifications(msgspec.Struct, kw_only=True):
    """A burst of notifications, from one agent or from every one, drained by P."""

    agents: int
    notifications: int
    received: int
    wall_ms: float
    own_cpu_us: float  # per notification, beyond idle
    nixl_cpu_us: float


class PerPeer(msgspec.Struct, kw_only=True):
    """What one more connected agent costs P, from the idle readings and the handshakes."""

    rss_mb: float  # slope from the first connected reading to the last
    fds: float
    threads: float
    first_rss_mb: float  # the first agent's, against none
    first_fds: int
    first_threads: int
    handshake_own_cpu_ms: float  # median over the handshakes after the first
    handshake_nixl_cpu_ms: float
    first_handshake_own_cpu_ms: float
    first_handshake_nixl_cpu_ms: float
    fetch_ms: float  # medians, every handshake
    add_ms: float
    connect_ms: float


class Run(msgspec.Struct, kw_only=True):
    """Everything measured with one P configuration."""

    progress: str  # "thread" (vLLM's) or "poll"
    metadata_bytes: int
    handshakes_served: int
    idle: list[Idle]
    handshakes: list[Handshake]
    notifications: list[Notifications]
    per_peer: PerPeer


class Report(msgspec.Struct, kw_only=True):
    settings: dict[str, object]
    load_before: list[float]  # /proc/loadavg, 1, 5 and 15 minutes
    load_after: list[float]
    runs: list[Run]


def per_peer(readings: list[Idle], handshakes: list[Handshake]) -> PerPeer:
    """The slopes of the idle readings and the medians of the handshakes."""
    none, first, last = readings[0], readings[1], readings[-1]
    span = max(last.peers - first.peers, 1)
    later = handshakes[1:] or handshakes

    def median(values: list[float]) -> float:
        return statistics.median(values)

    return PerPeer(
        rss_mb=(last.rss_mb - first.rss_mb) / span,
        fds=(last.fds - first.fds) / span,
        threads=(last.threads - first.threads) / span,
        first_rss_mb=first.rss_mb - none.rss_mb,
        first_fds=first.fds - none.fds,
        first_threads=first.threads - none.threads,
        handshake_own_cpu_ms=median([h.own_cpu_ms for h in later]),
        handshake_nixl_cpu_ms=median([h.nixl_cpu_ms for h in later]),
        first_handshake_own_cpu_ms=handshakes[0].own_cpu_ms,
        first_handshake_nixl_cpu_ms=handshakes[0].nixl_cpu_ms,
        fetch_ms=median([h.fetch_ms for h in handshakes]),
        add_ms=median([h.add_ms for h in handshakes]),
        connect_ms=median([h.connect_ms for h in handshakes]),
    )


_TITLES = {
    "thread": "P as vLLM 0.33.0 creates it (NIXL progress thread on, UCX num_threads=4)",
    "poll": "P without the progress thread (UCX progress only in get_new_notifs())",
}


def render(report: Report) -> str:
    """The tables: per run, the idle readings, the per-peer figures, the notification bursts."""
    lines = [f"load average before {report.load_before}, after {report.load_after}"]
    for run in report.runs:
        spins = run.progress == "thread"
        lines += ["", f"{_TITLES[run.progress]}; agent metadata {run.metadata_bytes} bytes", ""]
        lines.append("peers  RSS MB   fds  threads  own cores  NIXL cores  get_new_notifs us")
        for r in run.idle:
            lines.append(
                f"{r.peers:5d}  {r.rss_mb:6.1f}  {r.fds:4d}  {r.threads:7d}  {r.own_cores:9.3f}"
                f"  {r.nixl_cores:10.3f}  {r.poll_us:17.1f}"
            )
        p = run.per_peer
        nixl = "spinning, not separable" if spins else f"{p.handshake_nixl_cpu_ms:.2f} ms"
        first_nixl = "-" if spins else f"{p.first_handshake_nixl_cpu_ms:.2f}"
        lines += [
            f"per extra peer: {p.rss_mb:+.2f} MB RSS, {p.fds:+.2f} fds, {p.threads:+.2f} threads"
            f" (the first: {p.first_rss_mb:+.2f} MB, {p.first_fds:+d} fds, {p.first_threads:+d} threads)",
            f"P's CPU per handshake (median, after the first): own threads {p.handshake_own_cpu_ms:.2f} ms,"
            f" NIXL's {nixl} (the first: {p.first_handshake_own_cpu_ms:.2f} / {first_nixl} ms)",
            f"peer side, medians: fetch {p.fetch_ms:.1f} ms, add_remote_agent {p.add_ms:.1f} ms,"
            f" until P has its first notification {p.connect_ms:.1f} ms",
        ]
        for n in run.notifications:
            nixl_us = "-" if spins else f"{n.nixl_cpu_us:.1f}"
            lines.append(
                f"{n.notifications} notifications from {n.agents} agent(s): P received {n.received},"
                f" CPU per notification own {n.own_cpu_us:.1f} us, NIXL {nixl_us} us"
            )
    return "\n".join(lines)
