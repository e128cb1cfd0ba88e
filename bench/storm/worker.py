"""The storm generator of ``bench.storm``: a child process of its own, driven over stdin/stdout.

It runs apart from the process measuring the other requests, so the storm's
client-side work does not sit in that process's event loop and inflate the
latencies it measures (both still share the load core with D and P, as the
sidecar's clients would share a machine). One JSON object per line each way:

* ``{"cmd": "prepare", "count": N, "bound": S}``: run ``N`` prefill legs on P
  (each pins blocks and answers real ``kv_transfer_params``), or as many as
  ``S`` seconds allow, and keep the decode bodies that carry them; answers
  ``{"prepared": n, "seconds": s, "errors": e, ...}``.
* ``{"cmd": "storm", "release": true, "count": N, "bound": S}``: send decode
  requests through the sidecar as fast as ``connections`` closed loops allow,
  each body invalid for D (``max_tokens: "x"``, a 400 before the handler).
  With ``release`` every body carries the next unused prepared parameters (so
  the sidecar releases each), the storm stops when ``N`` are spent; without,
  the same bodies carry no parameters (nothing to release) and the storm runs
  for ``bound`` seconds. Answers ``{"event": "started", "at": t}`` when the
  first request goes out, then ``{"event": "done", ...}`` with the window
  (``time.monotonic()``, system-wide on Linux), the count and the statuses.
* ``{"cmd": "quit"}`` or end of input: exit.

    python -m bench.storm.worker --prefill-url URL --sidecar-url URL --model NAME --connections 32
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections import Counter
from typing import Any

import aiohttp
import msgspec
import uvloop

from bench.harness.load import HEADERS, Failures, client_session
from bench.releases.launch import PROMPT


class Command(msgspec.Struct, forbid_unknown_fields=True):
    cmd: str
    count: int = 0
    release: bool = True
    bound: float = 10.0


class _Storm:
    """Counts and the shared stop condition of one storm."""

    def __init__(self, bodies: list[tuple[str, bytes]], release: bool, count: int, bound: float) -> None:
        self.bodies = bodies
        self.release = release
        self.remaining = count if release else -1
        self.deadline = time.monotonic() + bound
        self.statuses: Counter[int] = Counter()
        self.failures = Failures()

    def take(self) -> bool:
        if self.remaining == 0:
            return False
        if time.monotonic() > self.deadline:
            return False
        if self.remaining > 0:
            self.remaining -= 1
        return True


class Worker:
    def __init__(self, prefill_url: str, sidecar_url: str, model: str, connections: int) -> None:
        self._prefill_url = prefill_url + "/v1/completions"
        self._sidecar_url = sidecar_url + "/v1/completions"
        self._model = model
        self._connections = connections
        self._bodies: list[tuple[str, bytes]] = []  # (request id, decode body with P's parameters)
        self._control = msgspec.json.encode(self._decode_body(None))
        self._session: aiohttp.ClientSession | None = None

    def _decode_body(self, params: dict[str, Any] | None) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self._model, "prompt": PROMPT, "max_tokens": "x"}
        if params is not None:
            body["kv_transfer_params"] = params
        return body

    async def serve(self) -> None:
        async with client_session(self._connections, 30.0) as self._session:
            loop = asyncio.get_running_loop()
            while True:
                line = await loop.run_in_executor(None, sys.stdin.readline)
                if not line.strip():
                    return
                command = msgspec.json.decode(line, type=Command)
                if command.cmd == "quit":
                    return
                if command.cmd == "prepare":
                    _emit(await self._prepare(command.count, command.bound))
                elif command.cmd == "storm":
                    _emit(await self._storm(command))
                else:
                    _emit({"error": f"unknown command {command.cmd!r}"})

    async def _prepare(self, count: int, bound: float) -> dict[str, Any]:
        started = time.monotonic()
        deadline = started + bound
        next_index = len(self._bodies)
        ids = iter(range(next_index, next_index + count))
        failed = Failures()

        async def leg() -> None:
            for index in ids:
                if time.monotonic() > deadline:
                    return
                request_id = f"storm-{index}"
                try:
                    params = await self._prefill(request_id)
                except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
                    failed.fail(repr(exc))
                    continue
                self._bodies.append((request_id, msgspec.json.encode(self._decode_body(params))))

        await asyncio.gather(*(leg() for _ in range(self._connections)))
        return {
            "prepared": len(self._bodies) - next_index,
            "seconds": time.monotonic() - started,
            "errors": failed.errors,
            "first_errors": failed.first_errors,
        }

    async def _prefill(self, request_id: str) -> dict[str, Any]:
        assert self._session is not None
        body = {
            "model": self._model,
            "prompt": PROMPT,
            "max_tokens": 1,
            "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False},
        }
        headers = {**HEADERS, "x-request-id": request_id}
        async with self._session.post(
            self._prefill_url, data=msgspec.json.encode(body), headers=headers
        ) as r:
            data = await r.read()
        if r.status != 200:
            raise ValueError(f"P answered {r.status}: {data[:200]!r}")
        params = msgspec.json.decode(data).get("kv_transfer_params")
        if not isinstance(params, dict) or params.get("do_remote_prefill") is not True:
            raise ValueError(f"P answered no usable kv_transfer_params: {data[:200]!r}")
        return params

    async def _storm(self, command: Command) -> dict[str, Any]:
        count = min(command.count, len(self._bodies)) if command.release else 0
        if command.release and count == 0:
            return {"event": "done", "error": "no prepared parameters left"}
        bodies, self._bodies = self._bodies[:count], self._bodies[count:]
        storm = _Storm(bodies, command.release, count, command.bound)
        started = time.monotonic()
        _emit({"event": "started", "at": started})
        await asyncio.gather(*(self._loop(storm, worker) for worker in range(self._connections)))
        ended = time.monotonic()
        return {
            "event": "done",
            "started": started,
            "ended": ended,
            "requests": sum(storm.statuses.values()) + storm.failures.errors,
            "statuses": {str(status): n for status, n in sorted(storm.statuses.items())},
            "errors": storm.failures.errors,
            "first_errors": storm.failures.first_errors,
            "unused": max(0, storm.remaining) + len(self._bodies),  # prepared parameters never sent
        }

    async def _loop(self, storm: _Storm, worker: int) -> None:
        assert self._session is not None
        sent = 0
        while storm.take():
            if storm.release:
                request_id, body = storm.bodies[storm.remaining]  # each body exactly once
            else:
                request_id, body = f"control-{worker}-{sent}", self._control
            sent += 1
            headers = {**HEADERS, "x-request-id": request_id}
            try:
                async with self._session.post(self._sidecar_url, data=body, headers=headers) as response:
                    await response.read()
                storm.statuses[response.status] += 1
            except (aiohttp.ClientError, TimeoutError) as exc:
                storm.failures.fail(repr(exc))


def _emit(message: dict[str, Any]) -> None:
    sys.stdout.write(msgspec.json.encode(message).decode() + "\n")
    sys.stdout.flush()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prefill-url", required=True)
    parser.add_argument("--sidecar-url", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--connections", type=int, default=32)
    args = parser.parse_args()
    worker = Worker(args.prefill_url, args.sidecar_url, args.model, args.connections)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(worker.serve())


if __name__ == "__main__":
    main()
