"""The running simulated P: block pool, NIXL workers and side-channel listeners.

``PrefillSim`` composes the pieces and owns their lifetimes. ``start``,
``stop`` and ``restart_agents`` block (agent creation takes a fraction of a
second each), so the app calls them through ``asyncio.to_thread``;
``prefill`` and ``stats`` only take the pool's lock and are safe on the event
loop. The handshake table is replaced as a whole on restart, so a listener
thread always reads one consistent generation of metadata.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

import zmq

from sidecar.sim.prefill.agents import WorkerGroup, WorkerSpec
from sidecar.sim.prefill.config import PrefillSimConfig
from sidecar.sim.prefill.listener import ListenerThread, bind_listeners
from sidecar.sim.prefill.openai import Route, emitted_blocks, kv_transfer_params, request_ids
from sidecar.sim.prefill.pool import BlockPool
from sidecar.sim.prefill.wire import (
    BYTES_PER_TOKEN,
    EngineShape,
    HandshakeKey,
    encode_handshake,
    handshake_key,
)

logger = logging.getLogger("sidecar.sim.prefill")


@dataclass(frozen=True, slots=True)
class PrefillOutcome:
    """What one answered request produced."""

    response_id: str
    internal_id: str
    kv_transfer_params: dict[str, Any] | None
    pinned: bool


class PrefillSim:
    """One simulated prefill engine."""

    def __init__(self, config: PrefillSimConfig) -> None:
        self.config = config
        self.release = config.release
        self.engine_id = config.engine_id or str(uuid.uuid4())
        self.pool = BlockPool(
            self.release,
            num_blocks=config.num_blocks,
            tp=config.tp,
            pp=config.pp,
            lease=config.effective_lease,
        )
        self.shape = EngineShape(
            self.engine_id, config.num_blocks, config.block_size, config.tp, config.model
        )
        self.side_channel_port = 0
        self.generation = 0
        self._table: dict[HandshakeKey, bytes] = {}
        self._group: WorkerGroup | None = None
        self._ctx: zmq.Context[zmq.Socket[bytes]] | None = None
        self._listeners: list[ListenerThread] = []
        self._lock = threading.Lock()  # guards _handshakes_served
        self._restart_lock = threading.Lock()
        self._handshakes_served = 0
        self._first_handshake_at: float | None = None  # time.monotonic() of the first one served

    # -- lifetime (blocking) ---------------------------------------------------

    def start(self) -> None:
        """Create the agents, then bind and start the side channel."""
        self._install(self._start_group())
        self._ctx = zmq.Context()
        try:
            self._start_listeners(self._ctx)
        except BaseException:
            self.stop()
            raise
        logger.info(
            "sim P %s (vLLM %s, TP %d, PP %d) side channel %s:%d, agents %s",
            self.engine_id,
            self.release.version,
            self.config.tp,
            self.config.pp,
            self.config.side_channel_host,
            self.side_channel_port,
            self.agent_names,
        )

    def stop(self) -> None:
        """Stop the listeners, terminate ZMQ, stop the workers and drop the agents."""
        for listener in self._listeners:
            listener.stop()
        self._listeners = []
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
        if self._group is not None:
            self._group.stop()
            self._group = None

    def restart_agents(self) -> list[str]:
        """Replace every NIXL agent (new names, new metadata); returns the new names."""
        with self._restart_lock:
            new = self._start_group()
            old = self._group
            self._install(new)
            self.generation += 1
        if old is not None:
            old.stop()
        return self.agent_names

    def _start_group(self) -> WorkerGroup:
        cfg = self.config
        specs = [
            WorkerSpec(
                tp_rank=tp_rank,
                pp_rank=pp_rank,
                tp=cfg.tp,
                num_blocks=cfg.num_blocks,
                block_len=cfg.block_size * BYTES_PER_TOKEN,
                poll_interval=cfg.poll_interval,
            )
            for pp_rank in range(cfg.pp)
            for tp_rank in range(cfg.tp)
        ]
        return WorkerGroup.start(specs, self.pool, cfg.agent_start_timeout)

    def _install(self, group: WorkerGroup) -> None:
        self._table = {
            handshake_key(self.release, ident): encode_handshake(self.release, ident, self.shape)
            for ident in group.identities
        }
        self._group = group

    def _start_listeners(self, ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
        count = 1 if self.release.scheduler_listener else self.config.tp
        host = self.config.side_channel_host
        base, socks = bind_listeners(ctx, host, self.config.effective_side_channel_port, count)
        self.side_channel_port = base
        self._listeners = [
            ListenerThread(sock, self.release, self._current_table, rank, self._served)
            for rank, sock in enumerate(socks)
        ]
        for listener in self._listeners:
            listener.start()

    def _current_table(self) -> dict[HandshakeKey, bytes]:
        return self._table

    def _served(self) -> None:
        with self._lock:
            self._handshakes_served += 1
            if self._first_handshake_at is None:
                self._first_handshake_at = time.monotonic()

    # -- requests (event loop) -------------------------------------------------

    def prefill(
        self, route: Route, tokens: int, remote_decode: bool, x_request_id: str | None
    ) -> PrefillOutcome:
        """Run one prefill; raises ``PoolFull`` / ``DuplicateRequest`` from the pool."""
        response_id, internal_id = request_ids(self.release, route, x_request_id)
        block_size = self.config.block_size
        blocks = self.pool.allocate(internal_id, -(-tokens // block_size))
        if not remote_decode:
            self.pool.release(blocks)
            return PrefillOutcome(response_id, internal_id, None, False)
        emitted = emitted_blocks(self.release, blocks, tokens, block_size)
        if emitted:
            self.pool.pin(internal_id, blocks)
        else:
            self.pool.release(blocks)  # P delays the free only if it holds a block
        params = kv_transfer_params(
            self.release,
            blocks=emitted,
            engine_id=self.engine_id,
            internal_id=internal_id,
            host=self.config.side_channel_host,
            port=self.side_channel_port,
            tp=self.config.tp,
            pp=self.config.pp,
            tokens=tokens,
            generation=self.generation,
        )
        return PrefillOutcome(response_id, internal_id, params, bool(emitted))

    # -- observation -----------------------------------------------------------

    @property
    def agent_names(self) -> list[str]:
        """Current agent names by rank (``pp_rank * tp + tp_rank``)."""
        group = self._group
        return group.agent_names if group is not None else []

    def stats(self) -> dict[str, Any]:
        """The ``/stats`` document."""
        data = self.pool.stats()
        alive = [listener.alive for listener in self._listeners]
        with self._lock:
            served, first = self._handshakes_served, self._first_handshake_at
        data.update(
            listener_alive=bool(alive) and all(alive),
            listener_dead=not (bool(alive) and all(alive)),
            listeners_alive=alive,
            listener_errors=[listener.error for listener in self._listeners],
            handshakes_served=served,
            first_handshake_at=first,
            version=self.release.version,
            engine_id=self.engine_id,
            side_channel_host=self.config.side_channel_host,
            side_channel_port=self.side_channel_port,
            tp_size=self.config.tp,
            pp_size=self.config.pp,
            agent_names=self.agent_names,
            registration_generation=self.generation,
        )
        return data

    def reset_counters(self) -> None:
        """Zero the counters of the pool and the side channel."""
        self.pool.reset_counters()
        with self._lock:
            self._handshakes_served = 0
