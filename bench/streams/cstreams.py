"""The many-streams load generator and fake D (``bench/streams/streams.c``): built, started, read.

A Python client (aiohttp, or even raw asyncio Protocols with llhttp) spends
10-15 us of CPU per SSE event it receives, and a Python D as much per event it
sends: 2,000 streams of 64 events over 2 s are 64,000 events/s each way, more
than the one core they share can give. The C program spends about 5 us per
event in the client and 7 in the server, most of it the kernel's loopback
send and receive, so both together stay under that core at 2,000 streams and
the hop between them is what fills first. Its CPU is reported beside every
figure.

``build`` compiles the source with the system's C compiler into
``out/cbin/`` (once per source version: the file name carries its hash);
``server_argv`` is D's command line; ``run_client`` runs one client phase as
a child process pinned to the load core and returns what it measured, the
percentiles computed here from the raw samples it wrote.
"""

from __future__ import annotations

import array
import asyncio
import hashlib
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import msgspec

from bench.harness.procs import BenchError, child_setup
from bench.harness.stats import ms, percentile

SOURCE = Path(__file__).with_name("streams.c")
CACHE = Path("out/cbin")


def build(cc: str | None = None, cache: Path = CACHE) -> Path:
    """The compiled program, built now unless this source's binary is already there."""
    source = SOURCE.read_bytes()
    binary = cache / f"streams-{hashlib.sha256(source).hexdigest()[:12]}"
    if binary.exists():
        return binary
    compiler = shutil.which(cc or "cc") or shutil.which("gcc")
    if compiler is None:
        raise BenchError(
            "the streams workload needs a C compiler (cc or gcc) to build bench/streams/streams.c"
        )
    cache.mkdir(parents=True, exist_ok=True)
    partial = binary.with_suffix(".tmp")
    result = subprocess.run(
        [compiler, "-O2", "-Wall", "-o", str(partial), str(SOURCE)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    if result.returncode != 0:
        raise BenchError(f"building bench/streams/streams.c failed:\n{result.stderr}")
    partial.rename(binary)
    return binary


def server_argv(binary: Path, port: int, events: int, duration: float) -> list[str]:
    return [str(binary), "server", "--port", str(port), "--events", str(events), "--duration", str(duration)]


class ClientReport(msgspec.Struct, kw_only=True):
    """The C client's own line of figures."""

    streams: int
    errors: int
    unfinished: int
    client_cpu: float
    client_wall: float
    events_total: int
    reconnects: int
    statuses: dict[str, int]
    first_errors: list[str]


class StreamsSample(msgspec.Struct, kw_only=True):
    """One client phase (times in ms), over the streams started after the ramp."""

    clients: int
    streams: int
    ttft_p50_ms: float
    ttft_p90_ms: float
    ttft_p99_ms: float
    ttft_max_ms: float
    gap_p50_ms: float
    gap_p99_ms: float
    gap_max_ms: float
    errors: int
    first_errors: list[str]
    statuses: dict[str, int]  # answers other than a whole 200 stream, by status
    events_total: int  # every event the clients received, ramp and drain included
    reconnects: int
    client_cpu: float
    client_wall: float
    # Per second of the window: streams started, their TTFT p50 and p99 (ms).
    timeline: list[tuple[int, float, float]]


@dataclass(frozen=True, slots=True)
class Phase:
    """One client phase: who to load, how hard, how long."""

    port: int
    clients: int
    seconds: float
    ramp: float
    events: int
    body: bytes  # the stream request: "@ID@" a request id, "@PARAMS@" P's parameters
    prefill_port: int = 0  # two legs: the prefill leg to this port first
    prefill_body: bytes = b""
    drain: float = 15.0


async def run_client(binary: Path, cpus: frozenset[int], phase: Phase) -> StreamsSample:
    """Run one phase as a child process on ``cpus`` and read what it measured."""
    with tempfile.TemporaryDirectory(prefix="kvr-streams-") as scratch:
        work = Path(scratch)
        (work / "body").write_bytes(phase.body)
        argv = [str(binary), "client", "--port", str(phase.port), "--clients", str(phase.clients)]
        argv += ["--seconds", str(phase.seconds), "--ramp", str(phase.ramp), "--drain", str(phase.drain)]
        argv += ["--events", str(phase.events), "--body", str(work / "body"), "--out", str(work / "out")]
        if phase.prefill_port:
            (work / "prefill").write_bytes(phase.prefill_body)
            argv += ["--prefill-port", str(phase.prefill_port), "--prefill-body", str(work / "prefill")]
        process = await asyncio.create_subprocess_exec(
            *argv,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            preexec_fn=child_setup(cpus),
        )
        bound = phase.ramp + phase.seconds + phase.drain + 30
        try:
            out, err = await asyncio.wait_for(process.communicate(), bound)
        except TimeoutError as exc:
            process.kill()
            raise BenchError(f"the streams client did not finish within {bound:.0f} s") from exc
        if process.returncode != 0:
            raise BenchError(f"the streams client exited {process.returncode}: {err.decode()[-2000:]}")
        report = msgspec.json.decode(out, type=ClientReport)
        return sample(report, phase, _doubles(work / "out.ttft"), _doubles(work / "out.gaps"))


def _doubles(path: Path) -> array.array[float]:
    values = array.array("d")
    values.frombytes(path.read_bytes())  # native doubles, written on this machine
    return values


def sample(
    report: ClientReport, phase: Phase, records: array.array[float], gaps: array.array[float]
) -> StreamsSample:
    """The figures of one phase from the client's report and raw samples."""
    starts, ttfts = records[0::2], records[1::2]
    ordered = sorted(ttfts) or [0.0]
    gap_list = sorted(gaps) or [0.0]
    return StreamsSample(
        clients=phase.clients,
        streams=report.streams,
        ttft_p50_ms=ms(percentile(ordered, 50)),
        ttft_p90_ms=ms(percentile(ordered, 90)),
        ttft_p99_ms=ms(percentile(ordered, 99)),
        ttft_max_ms=ms(ordered[-1]),
        gap_p50_ms=ms(percentile(gap_list, 50)),
        gap_p99_ms=ms(percentile(gap_list, 99)),
        gap_max_ms=ms(gap_list[-1]),
        errors=report.errors,
        first_errors=report.first_errors,
        statuses=report.statuses,
        events_total=report.events_total,
        reconnects=report.reconnects,
        client_cpu=report.client_cpu,
        client_wall=report.client_wall,
        timeline=timeline(list(starts), list(ttfts), phase.seconds),
    )


def timeline(starts: list[float], ttfts: list[float], seconds: float) -> list[tuple[int, float, float]]:
    """Per second of the window: (streams started, TTFT p50 ms, TTFT p99 ms)."""
    buckets: list[list[float]] = [[] for _ in range(max(1, int(seconds + 0.999)))]
    for start, ttft in zip(starts, ttfts, strict=True):
        buckets[min(len(buckets) - 1, max(0, int(start)))].append(ttft)
    return [
        (len(b), ms(percentile(b, 50)) if b else 0.0, ms(percentile(b, 99)) if b else 0.0) for b in buckets
    ]
