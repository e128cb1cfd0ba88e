"""The load sides of ``bench.storm``.

``NormalLoad`` is the traffic whose latency the storm may hurt: admitted chat
completions (no ``kv_transfer_params``, so nothing to release) through the
sidecar over a fixed number of closed-loop keep-alive connections, in this
process, until told to stop; every answer must be a 200. ``StormWorker``
drives the storm generator (``bench.storm.worker``), a child process of its
own on the load core. The readings taken around its phases are
``bench.releases.metrics``.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import aiohttp
import msgspec

from bench.harness.load import HEADERS, ROUTE, Connections, Failures
from bench.harness.procs import BenchError, child_setup


@dataclass(slots=True)
class Timed(Failures):
    """The other requests of one phase: (start, seconds) of every answered one, and what failed."""

    samples: list[tuple[float, float]] = field(default_factory=list)

    def within(self, start: float, end: float) -> list[float]:
        """Latencies of the requests sent inside ``[start, end]`` (however long they took)."""
        return [seconds for at, seconds in self.samples if start <= at <= end]


class NormalLoad(Connections):
    """``connections`` closed loops of admitted JSON requests through the sidecar."""

    def __init__(self, sidecar_url: str, model: str, connections: int, request_timeout: float) -> None:
        super().__init__(connections, request_timeout)
        self._url = sidecar_url + ROUTE
        self._body = msgspec.json.encode(
            {
                "model": model,
                "messages": [{"role": "user", "content": "Say hello to the benchmark."}],
                "max_tokens": 16,
            }
        )

    async def run(self, stop: asyncio.Event) -> Timed:
        """Send over every connection until ``stop`` is set (each loop finishes its request)."""
        timed = Timed()
        await asyncio.gather(*(self._loop(stop, timed) for _ in range(self._connections)))
        return timed

    async def run_for(self, seconds: float) -> Timed:
        stop = asyncio.Event()
        asyncio.get_running_loop().call_later(seconds, stop.set)
        return await self.run(stop)

    async def _loop(self, stop: asyncio.Event, timed: Timed) -> None:
        while not stop.is_set():
            started = time.monotonic()
            try:
                async with self.session.post(self._url, data=self._body, headers=HEADERS) as response:
                    body = await response.read()
            except (aiohttp.ClientError, TimeoutError) as exc:
                timed.fail(repr(exc))
                continue
            elapsed = time.monotonic() - started
            if response.status != 200:
                timed.fail(f"answered {response.status}: {body[:200]!r}")
                continue
            timed.samples.append((started, elapsed))


class StormWorker:
    """The storm generator child: prepares P's parameters, then storms the sidecar on command."""

    def __init__(
        self, prefill_url: str, sidecar_url: str, model: str, connections: int, log_dir: Path
    ) -> None:
        self._argv = [
            sys.executable,
            "-m",
            "bench.storm.worker",
            "--prefill-url",
            prefill_url,
            "--sidecar-url",
            sidecar_url,
            "--model",
            model,
            "--connections",
            str(connections),
        ]
        self._log_path = log_dir / "storm-worker.log"
        self._process: asyncio.subprocess.Process | None = None

    @property
    def pid(self) -> int:
        assert self._process is not None
        return self._process.pid

    async def __aenter__(self) -> StormWorker:
        with self._log_path.open("wb") as log:
            self._process = await asyncio.create_subprocess_exec(
                *self._argv,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=log,
                # On this process's CPUs (the load core), dying with it.
                preexec_fn=child_setup(frozenset(os.sched_getaffinity(0))),
                start_new_session=True,  # its own scheduling group, like the servers
            )
        return self

    async def __aexit__(
        self, typ: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        process = self._process
        if process is None or process.returncode is not None:
            return
        try:
            assert process.stdin is not None
            process.stdin.write(b'{"cmd": "quit"}\n')
            await process.stdin.drain()
            await asyncio.wait_for(process.wait(), 5.0)
        except (OSError, TimeoutError):
            process.kill()
            await process.wait()

    async def send(self, command: Mapping[str, Any]) -> None:
        assert self._process is not None and self._process.stdin is not None
        self._process.stdin.write(msgspec.json.encode(command) + b"\n")
        await self._process.stdin.drain()

    async def receive(self, within: float) -> dict[str, Any]:
        """The worker's next answer; a dead or silent worker breaks the benchmark."""
        assert self._process is not None and self._process.stdout is not None
        try:
            line = await asyncio.wait_for(self._process.stdout.readline(), within)
        except TimeoutError:
            raise BenchError(f"storm worker silent for {within:.0f} s:\n{self.log_tail()}") from None
        if not line:
            raise BenchError(f"storm worker exited:\n{self.log_tail()}")
        answer: dict[str, Any] = msgspec.json.decode(line)
        if "error" in answer:
            raise BenchError(f"storm worker: {answer['error']}")
        return answer

    def log_tail(self, lines: int = 20) -> str:
        return "\n".join(self._log_path.read_text(errors="replace").splitlines()[-lines:])
