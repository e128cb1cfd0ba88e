"""The servers under test as child processes: start, pin, wait until ready, read, stop.

D (``sim-decode``) and the sidecar (``serve``) run as ``python -m sidecar``
children of this process, so their pids are the interpreters themselves and
``/proc/<pid>`` readings are theirs alone. Beside the sidecar, on its core,
run the reference hops: the relay (``python -m bench.relay``, the cheapest
hop Python can run) and, when an ``nginx`` binary is available, nginx (one
worker, upstream keep-alive, no buffering; configured in a temporary
directory). Each child's affinity is set in the child before exec, so every
thread or process it later starts inherits it. Each child gets its own
session, as separate services would: with the kernel's autogroup scheduling
a session is one scheduling group whose weight is split over the CPUs its
tasks use, so a sidecar sharing the load generator's session got a sliver of
its own core and, beside other busy processes, sat runnable for seconds. A
child also dies with this process (parent-death signal). Readiness is polled
against a deadline (D's ``GET /health``, the sidecar's ``GET /readyz`` on the
admin port, D's ``GET /health`` through the relay and through nginx), never
slept on a guess.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Literal, TypeVar

import aiohttp

HOST = "127.0.0.1"
STOP_TIMEOUT = 10.0
# ``python -P -c FROM_CHECKOUT DIR serve ...``: the sidecar of another checkout (a worktree) in this
# environment, for a before-and-after in one run.
FROM_CHECKOUT = (
    "import runpy, sys; sys.path.insert(0, sys.argv.pop(1)); sys.argv[0] = 'sidecar'; "
    "runpy.run_module('sidecar', run_name='__main__')"
)
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
_PR_SET_PDEATHSIG = 1

# The measured paths: straight to D, through the sidecar, through the reference hops.
PathName = Literal["direct", "sidecar", "baseline", "relay", "nginx"]
_Number = TypeVar("_Number", int, float)


class BenchError(Exception):
    """The benchmark itself broke (a server would not start, answers were wrong)."""


@dataclass(frozen=True, slots=True)
class CorePlan:
    """Which CPUs the load side (this process and D) and the sidecar run on."""

    load: frozenset[int]
    sidecar: frozenset[int]

    @property
    def pinned(self) -> bool:
        return not self.load & self.sidecar

    def describe(self, load: str = "load generator + D", sidecar: str = "sidecar") -> str:
        """Which CPUs ``load`` (what runs on the load core) and ``sidecar`` (on the other) got."""
        if not self.pinned:
            return f"not pinned: only CPUs {sorted(self.load)} available"
        return f"{load} on CPU {sorted(self.load)}, {sidecar} on CPU {sorted(self.sidecar)}"


def plan_cores() -> CorePlan:
    """The first available CPU for the load side, the second for the sidecar."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return CorePlan(frozenset(cpus), frozenset(cpus))
    return CorePlan(frozenset(cpus[:1]), frozenset(cpus[1:2]))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


class Child:
    """One server process, its log file, and its ``/proc`` readings."""

    def __init__(self, name: str, argv: list[str], cpus: frozenset[int], log_dir: Path) -> None:
        self.name = name
        self._log_path = log_dir / f"{name}.log"
        self._log: IO[bytes] = self._log_path.open("wb")
        self.process = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            preexec_fn=child_setup(cpus),
            start_new_session=True,
        )

    @property
    def pid(self) -> int:
        return self.process.pid

    def cpu_seconds(self) -> float:
        """utime + stime of the whole process (all threads) and of its live descendants (nginx's
        worker), from ``/proc/<pid>/stat``."""
        return cpu_seconds(self.pid) + sum(_gone_is_0(cpu_seconds, pid) for pid in _descendants(self.pid))

    def rss_bytes(self) -> int:
        """VmRSS from ``/proc/<pid>/status``, with that of its live descendants added."""
        own = _rss_bytes(self.pid)
        if not own:
            raise BenchError(f"{self.name}: no VmRSS in /proc/{self.pid}/status")
        return own + sum(_gone_is_0(_rss_bytes, pid) for pid in _descendants(self.pid))

    def log_tail(self, lines: int = 20) -> str:
        self._log.flush()
        text = self._log_path.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    def stop(self) -> None:
        """SIGTERM, then SIGKILL to its whole process group if it has not exited within ``STOP_TIMEOUT``."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.pid, signal.SIGKILL)  # its own session: it and its descendants only
                self.process.wait()
        self._log.close()


def cpu_seconds(pid: int) -> float:
    """utime + stime of one whole process (all its threads), from ``/proc/<pid>/stat``."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2 :].split()  # the command name may contain spaces
    return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0  # a zombie has no VmRSS line


def _descendants(pid: int) -> list[int]:
    """Live descendants of ``pid``, from ``/proc/<pid>/task/<tid>/children``."""
    found: list[int] = []
    parents = [pid]
    while parents:
        parent = parents.pop()
        for children in Path(f"/proc/{parent}/task").glob("*/children"):
            with contextlib.suppress(OSError):  # the task or the process just went
                kids = [int(kid) for kid in children.read_text().split()]
                found += kids
                parents += kids
    return found


def _gone_is_0(read: Callable[[int], _Number], pid: int) -> _Number:
    """``read(pid)``, or 0 when that process has just exited."""
    try:
        return read(pid)
    except (FileNotFoundError, ProcessLookupError):
        return 0


def child_setup(cpus: frozenset[int]) -> Callable[[], None]:
    """Runs in the child between fork and exec: pin it, and have it die with us."""
    libc = ctypes.CDLL(None, use_errno=True)

    def setup() -> None:
        os.sched_setaffinity(0, cpus)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)

    return setup


def sidecar_argv(*args: str, checkout: Path | None = None) -> list[str]:
    """``python -m sidecar ARGS``, or the same of another checkout (``-P``: not this tree's package)."""
    if checkout is None:
        return [sys.executable, "-m", "sidecar", *args]
    return [sys.executable, "-P", "-c", FROM_CHECKOUT, str(checkout.resolve()), *args]


def serve_args(decode_url: str, port: int, admin: int) -> list[str]:
    """``serve`` as every measured sidecar runs: dry-run, quiet, quick to stop."""
    return [
        "serve", "--decode-url", decode_url, "--host", HOST, "--port", str(port),
        "--admin-host", HOST, "--admin-port", str(admin), "--release", "dry-run",
        "--log-level", "error", "--drain-timeout", "2", "--flush-timeout", "1",
    ]  # fmt: skip


@dataclass(frozen=True, slots=True)
class Servers:
    """D, the sidecar and the reference hops as started (``wait_ready`` tells when all answer)."""

    decode: Child
    sidecar: Child
    relay: Child
    nginx: Child | None  # only when an nginx binary was given or found
    decode_url: str
    sidecar_url: str
    admin_url: str
    relay_url: str
    nginx_url: str | None
    baseline: Child | None = None  # another checkout's sidecar (``--baseline``)
    baseline_url: str | None = None

    def paths(self) -> tuple[PathName, ...]:
        """The paths to measure, in their base order."""
        every: tuple[PathName, ...] = ("direct", "sidecar", "baseline", "relay", "nginx")
        return tuple(path for path in every if path == "direct" or self.proxy(path) is not None)

    def url(self, path: PathName) -> str:
        """The base URL the load generator sends ``path``'s requests to."""
        urls = {
            "direct": self.decode_url,
            "sidecar": self.sidecar_url,
            "baseline": self.baseline_url,
            "relay": self.relay_url,
            "nginx": self.nginx_url,
        }
        url = urls[path]
        if url is None:
            raise BenchError(f"no {path} server was started")
        return url

    def proxy(self, path: PathName) -> Child | None:
        """The process between the load generator and D on ``path`` (none on the direct path)."""
        hops = {"direct": None, "sidecar": self.sidecar, "baseline": self.baseline}
        return {**hops, "relay": self.relay, "nginx": self.nginx}[path]

    def proxies(self) -> list[Child]:
        """Every process on the sidecar's core."""
        hops = (self.sidecar, self.baseline, self.relay, self.nginx)
        return [child for child in hops if child is not None]


Start = Callable[[str, list[str], frozenset[int]], Child]


@contextlib.contextmanager
def starting(prefix: str) -> Iterator[tuple[Path, Start]]:
    """A temporary log directory, and ``start(name, argv, cpus)``, which starts a ``Child`` logging
    into it; on exit every child stops (last started first), then the directory goes."""
    with tempfile.TemporaryDirectory(prefix=prefix) as logs, contextlib.ExitStack() as running:
        log_dir = Path(logs)

        def start(name: str, argv: list[str], cpus: frozenset[int]) -> Child:
            child = Child(name, argv, cpus, log_dir)
            running.callback(child.stop)
            return child

        yield log_dir, start


@contextlib.contextmanager
def launched(
    plan: CorePlan, stream_events: int, nginx: str | None = None, baseline: Path | None = None
) -> Iterator[Servers]:
    """Start D, the sidecar, the relay, (given its binary) nginx and (given a checkout) another
    revision's sidecar, not yet known ready; stop all on exit."""
    d_port, s_port, a_port, r_port, n_port = (free_port() for _ in range(5))
    decode_url, sidecar_url = f"http://{HOST}:{d_port}", f"http://{HOST}:{s_port}"
    relay_url, nginx_url = f"http://{HOST}:{r_port}", f"http://{HOST}:{n_port}"
    with starting("kvr-bench-") as (log_dir, start):
        decode = start(
            "sim-decode",
            sidecar_argv(
                "sim-decode", "--host", HOST, "--port", str(d_port), "--stream-events", str(stream_events)
            ),
            plan.load,
        )
        sidecar = start("sidecar", sidecar_argv(*serve_args(decode_url, s_port, a_port)), plan.sidecar)
        relay = start(
            "relay",
            [sys.executable, "-m", "bench.relay", "--host", HOST, "--port", str(r_port),
             "--target", f"{HOST}:{d_port}"],
            plan.sidecar,
        )  # fmt: skip
        before = None
        if baseline is not None:
            b_port, b_admin = free_port(), free_port()
            argv = sidecar_argv(*serve_args(decode_url, b_port, b_admin), checkout=baseline)
            before = start("baseline", argv, plan.sidecar)
        proxy = None
        if nginx is not None:
            conf = nginx_config(nginx, log_dir, {n_port: f"{HOST}:{d_port}"})
            proxy = start("nginx", [nginx, "-p", f"{log_dir}/", "-c", str(conf)], plan.sidecar)
        yield Servers(
            decode,
            sidecar,
            relay,
            proxy,
            decode_url,
            sidecar_url,
            f"http://{HOST}:{a_port}",
            relay_url,
            nginx_url if proxy else None,
            before,
            f"http://{HOST}:{b_port}" if before else None,
        )


def nginx_config(
    nginx: str,
    directory: Path,
    listeners: Mapping[int, str],
    connections: int = 1024,
    keepalive: int = 64,
    workers: int = 1,
) -> Path:
    """Write nginx's configuration into ``directory`` and return its path.

    ``listeners``: each port nginx listens on, and the ``HOST:PORT`` it proxies to. ``workers``
    worker processes (1 unless given), each allowed ``connections`` connections (clients and
    upstreams together; its open-files limit raised to match), the log and every temporary path
    inside ``directory``, no access log, HTTP/1.1 keep-alive connections to each target
    (``keepalive`` kept idle) that are never closed after a number of requests (nor are the
    client's), and no buffering either way, so
    stream events pass as they come. The temporary path directives of the modules this binary
    was built without are left out (they would not parse).
    """
    built = subprocess.run([nginx, "-V"], capture_output=True, text=True, timeout=10, check=False).stderr
    temp_paths = "".join(
        f"  {module}_temp_path {directory}/{module};\n"
        for module in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
        if f"--without-http_{module}_module" not in built
    )
    servers = "".join(
        f"""  upstream t{port} {{ server {target}; keepalive {keepalive}; keepalive_requests 1000000; }}
  server {{
    listen {HOST}:{port} backlog=4096;
    location / {{
      proxy_pass http://t{port};
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_buffering off;
      proxy_request_buffering off;
    }}
  }}
"""
        for port, target in listeners.items()
    )
    conf = directory / "nginx.conf"
    conf.write_text(
        f"""worker_processes {workers};
worker_rlimit_nofile {2 * connections + 64};
daemon off;
pid {directory}/nginx.pid;
error_log stderr warn;
events {{ worker_connections {connections}; }}
http {{
  access_log off;
{temp_paths}  keepalive_requests 1000000;
{servers}}}
"""
    )
    return conf


async def wait_ready(servers: Servers, deadline: float) -> None:
    """Poll D's ``/health``, the sidecar's ``/readyz``, and D's ``/health`` through each reference hop,
    until 200 or ``deadline`` (monotonic)."""
    ready = {servers.decode: servers.decode_url + "/health", servers.sidecar: servers.admin_url + "/readyz"}
    ready[servers.relay] = servers.relay_url + "/health"
    if servers.nginx is not None and servers.nginx_url is not None:
        ready[servers.nginx] = servers.nginx_url + "/health"
    if servers.baseline is not None and servers.baseline_url is not None:
        ready[servers.baseline] = servers.baseline_url + "/health"  # D's, through it
    await wait_all_ready(ready, deadline)


async def wait_all_ready(ready: Mapping[Child, str], deadline: float) -> None:
    """Poll each child's readiness URL, in order, until 200, or raise past ``deadline`` (monotonic)."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2.0)) as session:
        for child, url in ready.items():
            await _poll(session, child, url, deadline)


async def _poll(session: aiohttp.ClientSession, child: Child, url: str, deadline: float) -> None:
    while True:
        if child.process.poll() is not None:
            raise BenchError(f"{child.name} exited with {child.process.returncode}:\n{child.log_tail()}")
        with contextlib.suppress(aiohttp.ClientError, TimeoutError):
            async with session.get(url) as response:
                if response.status == 200:
                    return
        if time.monotonic() > deadline:
            raise BenchError(f"{child.name} not ready at {url} before the deadline:\n{child.log_tail()}")
        await asyncio.sleep(0.05)  # poll interval, not a readiness guess
