"""wrk, the C load generator of the JSON phases, when it is installed.

A Python load generator on this machine saturates its core before a fast
hop does, which makes every hop look nearly free; wrk (one thread, epoll,
HTTP parsing in C) spends a fraction of that CPU per request. Each phase is
one wrk process (``-t1 -c<connections> -d<seconds>``), on the load core
(it inherits this process's affinity), sending the same chat request as the Python client
(a Lua script sets the POST body). The script's ``done`` hook prints, after
wrk's own report, the number of completed requests, the run's duration,
every error count and every populated bucket of wrk's latency histogram
(one microsecond wide), so rounds pool exactly. That histogram is wrk's own,
with its correction for coordinated omission (it adds the samples a request
stalled behind a slow one would have seen), so it holds a few more samples
than requests. wrk's CPU is read as ``done`` starts (Lua's ``os.clock``: the
user + system time of all its threads, what ``/proc/<pid>/stat`` says), so
the histogram printing after the run is not counted.

wrk counts any answer over 399 as a status error, and connection, read,
write and timeout failures as errors of their own; each is a failed request
of the sample, so ``load.check`` stops the benchmark on it. wrk takes whole
seconds, so a phase's time is rounded up to one.
"""

from __future__ import annotations

import asyncio
import math
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from bench.harness.load import ROUTE, Sample
from bench.harness.procs import BenchError

_SUMMARY = "bench-summary"
_BUCKET = "bench-latency"
_ERRORS = ("connect", "read", "write", "status", "timeout")

_LUA = """\
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.body = [==[{body}]==]

function done(summary, latency, requests)
  local cpu = os.clock()
  local e = summary.errors
  io.write(string.format("{summary} %d %d %.6f %d %d %d %d %d\\n", summary.requests, summary.duration,
    cpu, e.connect, e.read, e.write, e.status, e.timeout))
  for i = 1, #latency do
    local value, count = latency(i)
    io.write(string.format("{bucket} %d %d\\n", value, count))
  end
end
"""


def lua_script(body: bytes) -> str:
    """The wrk script that POSTs ``body`` as JSON and reports every figure on stdout."""
    text = body.decode()
    if "]==]" in text:
        raise ValueError("the request body would end the script's Lua long string")
    return _LUA.format(body=text, summary=_SUMMARY, bucket=_BUCKET)


def parse(output: str) -> Sample:
    """The ``Sample`` of one wrk run from its stdout: requests, wall time, CPU, errors, latencies."""
    sample = Sample()
    summary: list[str] | None = None
    for line in output.splitlines():
        name, _, rest = line.partition(" ")
        if name == _BUCKET:
            micros, count = (int(field) for field in rest.split())
            sample.latencies += [micros / 1e6] * count
        elif name == _SUMMARY:
            summary = rest.split()
    if summary is None or len(summary) != 3 + len(_ERRORS):
        raise BenchError(f"wrk printed no summary line:\n{output[-2000:]}")
    sample.completed, sample.wall, sample.client_cpu = (
        int(summary[0]),
        int(summary[1]) / 1e6,
        float(summary[2]),
    )
    for kind, count in zip(_ERRORS, (int(field) for field in summary[3:]), strict=True):
        if count:
            sample.errors += count
            sample.first_errors.append(f"wrk counted {count} {kind} error(s)")
    if sample.completed and not sample.latencies:
        raise BenchError(f"wrk printed no latency histogram:\n{output[-2000:]}")
    return sample


@dataclass(frozen=True, slots=True)
class Wrk:
    """An installed wrk binary and the script of the JSON phases, written into ``directory``."""

    binary: str
    version: str
    script: Path
    external: bool = True  # its own process: its CPU is its rusage, not this process's

    def describe(self) -> str:
        return f"wrk {self.version} ({self.binary}), one thread"

    async def run(self, base_url: str, connections: int, seconds: float, request_timeout: float) -> Sample:
        """One closed-loop run of ``connections`` connections for ``seconds`` (rounded up to whole ones)."""
        argv = [
            self.binary,
            "-t1",
            f"-c{connections}",
            f"-d{max(1, math.ceil(seconds))}s",
            f"--timeout={max(1, math.ceil(request_timeout))}s",
            "-s",
            str(self.script),
            base_url + ROUTE,
        ]
        # It inherits this process's affinity: the load core. Its output goes to a file, not a
        # pipe nobody reads while it runs.
        out = self.script.with_suffix(".out")
        with out.open("w+b") as sink:
            done = await asyncio.to_thread(
                subprocess.run, argv, stdin=subprocess.DEVNULL, stdout=sink, stderr=sink
            )
            sink.seek(0)
            output = sink.read().decode(errors="replace")
        if done.returncode != 0:
            raise BenchError(f"wrk exited with {done.returncode}:\n{output[-2000:]}")
        return parse(output)


def find_wrk(given: str | None, body: bytes, directory: Path) -> Wrk | None:
    """The wrk binary (``given``, else ``wrk`` on ``PATH``) ready to send ``body``, or None when absent."""
    binary = shutil.which(given or "wrk")
    if binary is None:
        return None
    banner = subprocess.run([binary, "-v"], capture_output=True, text=True, timeout=10, check=False)
    words = (banner.stdout + banner.stderr).split()
    version = words[1] if len(words) > 1 and words[0] == "wrk" else "(unknown version)"
    script = directory / "json.lua"
    script.write_text(lua_script(body))
    return Wrk(os.path.abspath(binary), version, script)
