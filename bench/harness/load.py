"""The Python load generator: a fixed number of aiohttp connections, each a closed loop.

``LoadClient`` holds one session whose pool is exactly ``concurrency``
connections (``Connections``, which the storm bench's other requests use
too); ``run`` starts that many workers, each sending its next request as
soon as the previous answer is fully read, until the shared count is spent
or the phase's time bound passes (so every phase stops by itself);
``run_for`` sends for a fixed time instead. Latency is measured around the
whole exchange; for SSE streams the time to the first body bytes (TTFB) and
to the end of the stream are both kept. Every answer is checked (status 200,
a stream ending with ``[DONE]``): wrong answers are errors (``Failures``
counts them and keeps the first few), and figures over errors mean nothing
(``check`` stops the benchmark on them). The CPU this process spent during
a run (the client's own cost, as this process does nothing else meanwhile)
goes with the sample, so a report can say when the client rather than the
server was saturated.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from types import TracebackType
from typing import Literal, Self

import aiohttp
import msgspec
from yarl import URL

from bench.harness.procs import BenchError, Child

Kind = Literal["json", "sse"]

ROUTE = "/v1/chat/completions"
MODEL = "sim-model"  # sim-decode's default served model
DONE = b"data: [DONE]\n\n"
HEADERS = {"content-type": "application/json"}
_MAX_ERRORS_KEPT = 5

# Eligible pull-mode parameters, so the sidecar takes its inspected path (decode the view,
# check the parameters, classify D's 200) on every request.
KV_TRANSFER_PARAMS = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_engine_id": "bench-prefill-0",
    "remote_request_id": "bench-request",
    "remote_host": "127.0.0.1",
    "remote_port": 5600,
    "remote_block_ids": [[1, 2, 3, 4]],
    "tp_size": 1,
}


def request_body(stream: bool, max_tokens: int = 64) -> bytes:
    """A small chat completion request carrying ``kv_transfer_params``."""
    return msgspec.json.encode(
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "Say hello to the benchmark."}],
            "max_tokens": max_tokens,
            "stream": stream,
            "kv_transfer_params": KV_TRANSFER_PARAMS,
        }
    )


def client_session(connections: int, timeout: float) -> aiohttp.ClientSession:
    """A session of at most ``connections`` keep-alive connections, ``timeout`` seconds a request,
    doing nothing a load generator does not need (no decompression, cookies or proxy settings)."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=connections, limit_per_host=connections),
        timeout=aiohttp.ClientTimeout(total=timeout),
        auto_decompress=False,
        trust_env=False,
        cookie_jar=aiohttp.DummyCookieJar(),
    )


class Connections:
    """``connections`` keep-alive connections (one ``client_session``), open inside ``async with``."""

    def __init__(self, connections: int, request_timeout: float) -> None:
        self._connections = connections
        self._timeout = request_timeout
        self._session: aiohttp.ClientSession | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        assert self._session is not None, "used outside its async with"
        return self._session

    async def __aenter__(self) -> Self:
        self._session = client_session(self._connections, self._timeout)
        return self

    async def __aexit__(
        self, typ: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._session is not None:
            await self._session.close()


@dataclass(slots=True)
class Failures:
    """Failed requests: how many, and what the first few were."""

    errors: int = 0
    first_errors: list[str] = field(default_factory=list)

    def fail(self, detail: str) -> None:
        self.errors += 1
        if len(self.first_errors) < _MAX_ERRORS_KEPT:
            self.first_errors.append(detail)


@dataclass(slots=True)
class Sample(Failures):
    """What one phase measured: per-request seconds and the phase's wall time, and what failed."""

    latencies: list[float] = field(default_factory=list)
    ttfbs: list[float] = field(default_factory=list)  # SSE only
    wall: float = 0.0
    bounded: bool = False  # the phase hit its time bound before its count was done
    client_cpu: float = 0.0  # CPU seconds (user + system) the load generator spent on the phase
    # Requests completed, where ``latencies`` holds more than one per request (wrk's
    # histogram, with its correction for coordinated omission); None: one latency each.
    completed: int | None = None

    def requests(self) -> int:
        """How many requests completed."""
        return len(self.latencies) if self.completed is None else self.completed


def check(sample: Sample, children: Iterable[Child], what: str) -> None:
    """Wrong answers break a benchmark: raise saying ``what`` failed, with the servers' last log lines."""
    if sample.errors:
        problem = f"{sample.errors} failed request(s); first: {sample.first_errors}"
    elif not sample.latencies:
        problem = "no request completed"
    else:
        return
    logs = "\n".join(f"--- {c.name} log:\n{c.log_tail()}" for c in children)
    raise BenchError(f"{what}: {problem}\n{logs}")


class _Budget:
    """The shared request count of one phase, and its deadline."""

    def __init__(self, count: int, bound: float) -> None:
        self.remaining = count
        self.deadline = time.monotonic() + bound
        self.expired = False

    def take(self) -> bool:
        if self.remaining <= 0:
            return False
        if time.monotonic() > self.deadline:
            self.expired = True
            return False
        self.remaining -= 1
        return True


class LoadClient(Connections):
    """``concurrency`` keep-alive connections to one base URL (direct D or the sidecar)."""

    def __init__(self, base_url: str, concurrency: int, request_timeout: float, max_tokens: int = 64) -> None:
        super().__init__(concurrency, request_timeout)
        self._url = URL(base_url + ROUTE)
        self._bodies = {"json": request_body(False, max_tokens), "sse": request_body(True, max_tokens)}

    async def run(self, kind: Kind, count: int, bound: float) -> Sample:
        """Send ``count`` requests of ``kind`` over every connection at once."""
        sample = Sample()
        budget = _Budget(count, bound)
        await self._run(kind, budget, sample)
        sample.bounded = budget.expired
        return sample

    async def run_for(self, kind: Kind, seconds: float) -> Sample:
        """Send requests of ``kind`` over every connection at once for ``seconds``."""
        sample = Sample()
        await self._run(kind, _Budget(sys.maxsize, seconds), sample)
        return sample

    async def _run(self, kind: Kind, budget: _Budget, sample: Sample) -> None:
        started, cpu = time.perf_counter(), time.process_time()
        await asyncio.gather(*(self._worker(kind, budget, sample) for _ in range(self._connections)))
        sample.wall = time.perf_counter() - started
        sample.client_cpu = time.process_time() - cpu

    async def _worker(self, kind: Kind, budget: _Budget, sample: Sample) -> None:
        once = self._json_once if kind == "json" else self._sse_once
        while budget.take():
            try:
                await once(sample)
            except (aiohttp.ClientError, TimeoutError) as exc:
                sample.fail(repr(exc))

    async def _json_once(self, sample: Sample) -> None:
        started = time.perf_counter()
        async with self.session.post(self._url, data=self._bodies["json"], headers=HEADERS) as response:
            body = await response.read()
        elapsed = time.perf_counter() - started
        if response.status != 200:
            sample.fail(f"JSON answered {response.status}: {body[:200]!r}")
            return
        sample.latencies.append(elapsed)

    async def _sse_once(self, sample: Sample) -> None:
        started = time.perf_counter()
        async with self.session.post(self._url, data=self._bodies["sse"], headers=HEADERS) as response:
            content = response.content
            chunk = await content.readany()
            first = time.perf_counter() - started
            tail = chunk
            while chunk:
                chunk = await content.readany()
                tail = (tail + chunk)[-len(DONE) :]
        elapsed = time.perf_counter() - started
        if response.status != 200 or not tail.endswith(DONE):
            sample.fail(f"stream answered {response.status}, ending {tail!r}")
            return
        sample.ttfbs.append(first)
        sample.latencies.append(elapsed)
