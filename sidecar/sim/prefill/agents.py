"""P's workers: one real NIXL agent per (PP rank, TP rank), each in its own thread.

A ``PrefillWorker`` thread creates its agent (a random UUID name, like vLLM),
registers a small DRAM region standing in for the KV cache, publishes the
agent metadata, then drains ``get_new_notifs()`` about every millisecond and
runs the lease reaper, as vLLM's worker does once per engine step. Only that
thread touches the agent (NIXL's default sync mode is not thread-safe); it
deregisters and drops the agent when stopped. The agents run without NIXL's
progress thread, which busy-spins a core each: the poll loop's
``get_new_notifs()`` drives UCX progress, which is all a receiver needs. ``WorkerGroup`` starts and stops
all workers of one engine together. ``nixl_cu12`` is imported lazily so the
CLI can build its parser without loading NIXL.
"""

from __future__ import annotations

import logging
import threading
import uuid
from dataclasses import dataclass
from typing import Any

from sidecar.sim.prefill.pool import BlockPool
from sidecar.sim.prefill.wire import WorkerIdentity

logger = logging.getLogger("sidecar.sim.prefill")


class AgentStartError(RuntimeError):
    """A worker could not create or register its NIXL agent."""


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """What a worker needs to know about itself and the engine."""

    tp_rank: int
    pp_rank: int
    tp: int
    num_blocks: int  # usable blocks; the region holds num_blocks + 1 (null block 0)
    block_len: int
    poll_interval: float

    @property
    def rank(self) -> int:
        """Index of this worker in per-rank lists: ``pp_rank * tp + tp_rank``."""
        return self.pp_rank * self.tp + self.tp_rank


class PrefillWorker:
    """One P worker thread owning one NIXL agent."""

    def __init__(self, spec: WorkerSpec, pool: BlockPool) -> None:
        self.spec, self._pool = spec, pool
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._identity: WorkerIdentity | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"sim-prefill-worker-{spec.rank}", daemon=True)

    def start(self) -> None:
        """Start the thread; the agent is created inside it."""
        self._thread.start()

    def wait_ready(self, timeout: float) -> WorkerIdentity:
        """Block until the agent exists; raises ``AgentStartError`` otherwise."""
        if not self._ready.wait(timeout):
            raise AgentStartError(f"worker {self.spec.rank}: NIXL agent not ready in {timeout}s")
        if self._identity is None:
            raise AgentStartError(f"worker {self.spec.rank}: {self._error!r}") from self._error
        return self._identity

    def request_stop(self) -> None:
        """Ask the thread to stop without waiting for it."""
        self._stop.set()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop polling, release the agent and join the thread."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _run(self) -> None:
        try:
            agent, registration, region = self._create_agent()
        except Exception as exc:  # reported through wait_ready
            self._error = exc
            self._ready.set()
            return
        try:
            self._ready.set()
            self._poll(agent)
        finally:
            try:
                agent.deregister_memory(registration, backends=["UCX"])
            except Exception:
                logger.exception("worker %d: deregister_memory failed", self.spec.rank)
            del agent, registration, region  # the last references: NIXL frees the agent

    def _create_agent(self) -> tuple[Any, Any, Any]:
        import numpy as np
        from nixl_cu12._api import nixl_agent, nixl_agent_config

        name = str(uuid.uuid4())
        agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
        region = np.zeros((self.spec.num_blocks + 1) * self.spec.block_len, dtype=np.uint8)
        descs = agent.get_reg_descs([(region.ctypes.data, region.nbytes, 0, "")], "DRAM")
        registration = agent.register_memory(descs, backends=["UCX"])
        self._identity = WorkerIdentity(
            tp_rank=self.spec.tp_rank,
            pp_rank=self.spec.pp_rank,
            agent_name=name,
            agent_metadata=agent.get_agent_metadata(),
            base_addr=int(region.ctypes.data),
            block_len=self.spec.block_len,
        )
        return agent, registration, region

    def _poll(self, agent: Any) -> None:
        rank = self.spec.rank
        while not self._stop.is_set():
            try:
                for messages in agent.get_new_notifs().values():
                    for raw in messages:
                        self._pool.on_notification(rank, bytes(raw))
                self._pool.reap(rank)
            except Exception:  # a poll error must not end the worker
                logger.exception("worker %d: notification poll failed", rank)
            self._stop.wait(self.spec.poll_interval)


class WorkerGroup:
    """All workers of one simulated engine, started and stopped together."""

    def __init__(self, workers: list[PrefillWorker], identities: list[WorkerIdentity]) -> None:
        self.workers, self.identities = workers, identities

    @classmethod
    def start(cls, specs: list[WorkerSpec], pool: BlockPool, timeout: float) -> WorkerGroup:
        """Create every agent (in parallel threads) and wait for all of them."""
        workers = [PrefillWorker(spec, pool) for spec in specs]
        for worker in workers:
            worker.start()
        try:
            identities = [worker.wait_ready(timeout) for worker in workers]
        except BaseException:
            for worker in workers:
                worker.stop()
            raise
        return cls(workers, identities)

    @property
    def agent_names(self) -> list[str]:
        """Agent names by rank."""
        return [identity.agent_name for identity in self.identities]

    def stop(self) -> None:
        """Stop every worker (in parallel) and drop the agents."""
        for worker in self.workers:
            worker.request_stop()
        for worker in self.workers:
            worker.stop()
