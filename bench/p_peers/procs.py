"""The child processes of ``bench.p_peers``: P's one NIXL agent, and the peers that connect to it.

Each child speaks JSON lines: it prints one ``ready`` line, then answers each
command read on stdin with one line on stdout (everything else the process
writes, NIXL's logs included, goes to stderr).

``p``: a prefill worker as vLLM 0.33.0 makes it. The agent is created the way
that release's connector creates P's (``nixl_agent_config(num_threads=4,
capture_telemetry=True)``, UCX, NIXL's progress thread on: ``--progress
thread``), or without the progress thread (``--progress poll``: UCX then only
makes progress when P calls ``get_new_notifs()``). It registers host memory
cut into per-layer regions as the connector registers its KV caches, serves
its metadata on a side channel of that release (the P simulator's listener
and payload encoding) and drains ``get_new_notifs()`` every ``--poll-ms`` on
one thread, as an engine step does; that thread is the only one that calls
the agent after its creation. It reports which of its threads are its own
(Python's, ZMQ's) and which NIXL started, so CPU can be split between them.

``peer``: one sidecar worker's NIXL agent, the sidecar's own ``NixlPeer``
(UCX, no progress thread) and ``HandshakeClient``: ``handshake`` fetches P's
metadata over the side channel and adds it (``add_remote_agent``), timing
both; ``notify`` sends notifications of vLLM 0.33.0's format to P.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import threading
import time
import uuid
from collections.abc import Sequence
from typing import Any

VLLM_VERSION = "0.34.0"
ENGINE_ID = "bench-p-peers"  # P's engine: its handshake reply names it, the D side checks it
NUM_THREADS = 4  # vLLM 0.33.0's default "num_threads" for P's UCX backend
HOST = "127.0.0.1"
BATCH = 32  # notifications per notify_many call on a peer


def threads(pid: int | str = "self") -> set[int]:
    """The thread ids of process ``pid``."""
    return {int(tid) for tid in os.listdir(f"/proc/{pid}/task")}


_REPLIES: list[Any] = []  # the original stdout, once ``main`` moved everything else to stderr


def reply(message: dict[str, Any]) -> None:
    print(json.dumps(message), file=_REPLIES[0], flush=True)


def _own_stdout() -> None:
    """Keep stdout for the replies: NIXL logs to fd 1 (from C++ and Python), so fd 1 goes to stderr."""
    _REPLIES.append(os.fdopen(os.dup(1), "w"))
    os.dup2(2, 1)


class Drain:
    """P's poll thread: ``get_new_notifs()`` every ``interval``, counting what arrives and its own CPU."""

    def __init__(self, agent: Any, interval: float) -> None:
        self._agent, self._interval = agent, interval
        self._stop = threading.Event()
        self._changed = threading.Condition()
        self.received = 0
        self.senders: set[str] = set()
        self.polls = 0
        self.poll_cpu = 0.0  # thread CPU seconds inside get_new_notifs()
        self.served = 0  # handshakes the side channel answered
        self.tid = 0
        self._thread = threading.Thread(target=self._run, name="p-drain", daemon=True)

    def start(self) -> None:
        self._thread.start()
        while not self.tid:
            time.sleep(0.001)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def wait(self, count: int, timeout: float) -> int:
        """Block until ``count`` notifications have arrived in all (or ``timeout``); the total."""
        with self._changed:
            self._changed.wait_for(lambda: self.received >= count, timeout)
            return self.received

    def handshake_served(self) -> None:
        """Called by the side-channel listener after each answer."""
        with self._changed:
            self.served += 1

    def stats(self) -> dict[str, Any]:
        with self._changed:
            return {
                "received": self.received,
                "senders": len(self.senders),
                "polls": self.polls,
                "poll_cpu_s": self.poll_cpu,
                "served": self.served,
            }

    def _run(self) -> None:
        self.tid = threading.get_native_id()
        while not self._stop.is_set():
            before = time.thread_time()
            notifs = self._agent.get_new_notifs()
            spent = time.thread_time() - before
            with self._changed:
                self.polls += 1
                self.poll_cpu += spent
                for sender, messages in notifs.items():
                    self.received += len(messages)
                    self.senders.add(sender)
                if notifs:
                    self._changed.notify_all()
            self._stop.wait(self._interval)


def make_agent(progress: str, regions: int, region_bytes: int) -> tuple[Any, Any, Any]:
    """P's agent as vLLM 0.33.0 creates it, with ``regions`` host regions registered; the agent, its
    registration and the memory."""
    import numpy as np
    from nixl_cu12._api import nixl_agent, nixl_agent_config

    options: dict[str, Any] = {"num_threads": NUM_THREADS, "capture_telemetry": True}
    if progress == "poll":
        options["enable_prog_thread"] = False
    agent = nixl_agent(str(uuid.uuid4()), nixl_agent_config(**options))
    memory = np.zeros(regions * region_bytes, dtype=np.uint8)
    base = int(memory.ctypes.data)
    ranges = [(base + i * region_bytes, region_bytes, 0, "") for i in range(regions)]
    registration = agent.register_memory(agent.get_reg_descs(ranges, "DRAM"), backends=["UCX"])
    return agent, registration, memory


def handshake_table(agent: Any, memory: Any, regions: int) -> dict[Any, bytes]:
    """P's side-channel payload for rank (0, 0), encoded as vLLM 0.33.0's listener sends it."""
    from sidecar.sim.prefill.release import release_for
    from sidecar.sim.prefill.wire import EngineShape, WorkerIdentity, encode_handshake, handshake_key

    release = release_for(VLLM_VERSION)
    block_len = memory.nbytes // regions
    worker = WorkerIdentity(0, 0, agent.name, agent.get_agent_metadata(), int(memory.ctypes.data), block_len)
    shape = EngineShape(ENGINE_ID, regions - 1, 16, 1, "sim-prefill")
    return {handshake_key(release, worker): encode_handshake(release, worker, shape)}


def serve_p(args: argparse.Namespace) -> int:
    """The ``p`` child: agent, side channel, drain; then commands until ``stop``."""
    import zmq

    from sidecar.sim.prefill.listener import ListenerThread, bind_listeners
    from sidecar.sim.prefill.release import release_for

    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    port, socks = bind_listeners(ctx, HOST, 0, 1)
    before = threads()  # Python's and ZMQ's threads, before NIXL starts any
    agent, registration, memory = make_agent(args.progress, args.regions, args.region_kb * 1024)
    table = handshake_table(agent, memory, args.regions)
    drain = Drain(agent, args.poll_ms / 1000)
    release = release_for(VLLM_VERSION)
    listener = ListenerThread(socks[0], release, lambda: table, (0, 0), drain.handshake_served)
    listener.start()
    drain.start()
    own = threads() - _nixl_threads(before)  # any thread started later is NIXL's too
    reply(
        {
            "ready": True,
            "pid": os.getpid(),
            "port": port,
            "metadata_bytes": len(agent.get_agent_metadata()),
            "own_tids": sorted(own),
        }
    )
    try:
        for line in sys.stdin:
            command = json.loads(line)
            if command["cmd"] == "stop":
                break
            if command["cmd"] == "wait":
                drain.wait(command["count"], command["timeout"])
            reply(drain.stats())
    finally:
        drain.stop()
        listener.stop()
        agent.deregister_memory(registration, backends=["UCX"])
        ctx.term()
    return 0


def _nixl_threads(before: set[int]) -> set[int]:
    """Threads started since ``before`` that are not Python's (the listener, the drain): NIXL's."""
    python = {t.native_id for t in threading.enumerate() if t.native_id is not None}
    return threads() - before - python


async def serve_peer() -> int:
    """The ``peer`` child: one sidecar NIXL agent; commands until ``stop``."""
    import zmq.asyncio

    from sidecar.nixl.handshake import HandshakeClient, Target
    from sidecar.nixl.messages import notification
    from sidecar.nixl.peer import NixlPeer
    from sidecar.nixl.versions import WireProfile

    profile = WireProfile.for_version(VLLM_VERSION)
    assert profile is not None
    context = zmq.asyncio.Context()
    client = HandshakeClient(context, timeout=30.0)
    peer = NixlPeer()
    await peer.start()
    reply({"ready": True, "pid": os.getpid(), "name": peer.name})
    remote = ""
    loop = asyncio.get_running_loop()
    try:
        while line := await loop.run_in_executor(None, sys.stdin.readline):
            command = json.loads(line)
            if command["cmd"] == "stop":
                break
            started = time.perf_counter()
            if command["cmd"] == "handshake":
                target = Target(HOST, HOST, command["port"])
                replies = await client.fetch(target, profile, [(0, 0)], ENGINE_ID)
                fetched = time.perf_counter()
                remote = await peer.add_remote(replies[(0, 0)].agent_metadata)
                added = time.perf_counter()
                reply({"fetch_ms": (fetched - started) * 1e3, "add_ms": (added - fetched) * 1e3})
                continue
            ids = [f"{command['prefix']}-{i}" for i in range(command["count"])]
            batches = [ids[i : i + BATCH] for i in range(0, len(ids), BATCH)]
            results = await asyncio.gather(
                *(
                    peer.notify_many([(remote, notification(profile, rid)) for rid in batch])
                    for batch in batches
                )
            )
            errors = [error for result in results for error in result if error is not None]
            reply(
                {
                    "sent": len(ids) - len(errors),
                    "errors": errors[:3],
                    "ms": (time.perf_counter() - started) * 1e3,
                }
            )
    finally:
        await peer.close()
        context.term()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.p_peers.procs", description=__doc__.split("\n")[0])
    parser.add_argument("role", choices=["p", "peer"])
    parser.add_argument("--progress", choices=["thread", "poll"], default="thread")
    parser.add_argument("--regions", type=int, default=64)
    parser.add_argument("--region-kb", type=int, default=128)
    parser.add_argument("--poll-ms", type=float, default=1.0)
    args = parser.parse_args(argv)
    _own_stdout()
    if args.role == "p":
        return serve_p(args)
    return asyncio.run(serve_peer())


if __name__ == "__main__":
    raise SystemExit(main())
