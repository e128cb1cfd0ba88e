"""P faked on real NIXL agents: ``FakePrefill`` serves vLLM's side channel (one ZMQ listener
per rank, the handshake of the release it plays) and records the notifications each rank's agent
gets; ``params_for`` and ``make_job`` are a release to it, as the sidecar makes one."""

from __future__ import annotations

import random
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import msgspec
import zmq

from sidecar.nixl.peer import import_nixl
from sidecar.nixl.versions import WireProfile
from sidecar.params import ReleaseParams
from sidecar.release.base import ReleaseJob
from tests.support.fakes import release_params
from tests.support.nixl_layouts import HandshakePayload, agent_metadata_layout
from tests.support.until import until_async

Rank = tuple[int, int]


def new_agent() -> Any:
    api = import_nixl()
    return api.nixl_agent(str(uuid.uuid4()), api.nixl_agent_config(backends=["UCX"]))


class FakePrefill:
    """P of one vLLM release on 127.0.0.1 (see the module docstring)."""

    def __init__(
        self,
        version: str,
        tp: int = 1,
        pp: int = 1,
        *,
        engine_id: str | None = None,
        agents: list[Any] | None = None,
        port: int | None = None,
        generation: int = 0,
    ) -> None:
        profile = WireProfile.for_version(version)
        assert profile is not None
        self.version, self.profile, self.tp, self.pp = version, profile, tp, pp
        self.engine_id = engine_id or f"p-{uuid.uuid4().hex[:8]}"
        self.generation = generation
        self.ranks: list[Rank] = [(p, t) for p in range(pp) for t in range(tp)]
        self.agents = dict(zip(self.ranks, agents or [new_agent() for _ in self.ranks], strict=True))
        self.requests = 0  # handshake requests served
        self.dead: list[str] = []  # listener threads that died, and why
        self.notifs: dict[Rank, list[bytes]] = {rank: [] for rank in self.ranks}
        self._stop = threading.Event()
        self._context = zmq.Context()
        self._sockets = self._bind(port)
        self.port = self._base
        self._threads = [threading.Thread(target=self._serve, args=(s,), daemon=True) for s in self._sockets]
        for thread in self._threads:
            thread.start()

    # --- side channel ----------------------------------------------------------------------
    def _bind(self, port: int | None) -> list[zmq.Socket[bytes]]:
        count = self.tp if self.profile.wire.listener == "worker" else 1
        for _ in range(50):
            base = port or random.randint(20000, 60000)
            sockets: list[zmq.Socket[bytes]] = []
            try:
                for i in range(count):
                    sock = self._context.socket(zmq.ROUTER)
                    sockets.append(sock)
                    sock.bind(f"tcp://127.0.0.1:{base + i}")
            except zmq.ZMQError:
                for sock in sockets:
                    sock.close(0)
                if port is not None:
                    raise
                continue
            self._base = base
            return sockets
        raise RuntimeError("no free port range")

    def encoded(self, rank: Rank) -> bytes:
        layout = agent_metadata_layout(self.profile.low)
        md = layout(engine_id=self.engine_id, agent_metadata=self.agents[rank].get_agent_metadata())
        data = msgspec.msgpack.encode(md)
        if self.profile.wire.payload == "handshake_payload":
            data = msgspec.msgpack.encode(HandshakePayload("0" * 64, data))
        return data

    def _serve(self, sock: zmq.Socket[bytes]) -> None:
        worker_tp = int(sock.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1]) - self._base
        try:
            while not self._stop.is_set():
                if not sock.poll(20):
                    continue
                identity, _, msg = sock.recv_multipart()
                rank = self._rank_of(msg, worker_tp)
                frames = [identity, b"", self.encoded(rank)]
                if self.profile.wire.reply_frames == 2:
                    frames.append(msgspec.msgpack.encode(time.perf_counter()))
                self.requests += 1
                sock.send_multipart(frames)
        except Exception as exc:  # like vLLM: anything but a timeout ends the listener
            self.dead.append(repr(exc))
        finally:
            sock.close(0)

    def _rank_of(self, msg: bytes, worker_tp: int) -> Rank:
        request = self.profile.wire.request
        if request == "raw":
            return (0, worker_tp)  # any single frame gets this worker's metadata
        decoded = msgspec.msgpack.decode(msg)
        if request == "tp":
            _, tp_rank = decoded  # ValueError on 3 elements, as in vLLM 0.11.1-0.25.x
            key: Rank = (0, tp_rank)
        else:
            _, pp_rank, tp_rank = decoded
            key = (pp_rank, tp_rank)
        if key not in self.agents:
            raise KeyError(key)
        return key

    def params(self, request_id: str, **override: Any) -> ReleaseParams:
        """kv_transfer_params as this P emits them."""
        fields = {"generation": self.generation, "tp": self.tp, "pp": self.pp}
        return params_for(self.version, self.engine_id, self.port, request_id, **fields, **override)

    # --- notifications ---------------------------------------------------------------------
    def drain(self) -> None:
        for rank, agent in self.agents.items():
            for messages in agent.get_new_notifs().values():
                self.notifs[rank].extend(messages)

    async def wait(self, done: Callable[[], bool], within: float = 5.0) -> None:
        def drained() -> bool:
            self.drain()
            return done()

        await until_async(drained, "P's notifications", within, 0.001, state=lambda: self.notifs)

    async def received(self, message: bytes, within: float = 5.0) -> dict[Rank, int]:
        """Wait until every rank has ``message``; returns how often each rank got it."""
        await self.wait(lambda: all(message in got for got in self.notifs.values()), within)
        return {rank: got.count(message) for rank, got in self.notifs.items()}

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(5)
        self._context.destroy(0)


def params_for(
    version: str,
    engine_id: str,
    port: int,
    request_id: str,
    *,
    tp: int = 1,
    pp: int = 1,
    generation: int = 0,
    **override: Any,
) -> ReleaseParams:
    """kv_transfer_params as P of ``version`` emits them (its scheduler's ``request_finished``)."""
    profile = WireProfile.for_version(version)
    assert profile is not None
    low = profile.low
    fields: dict[str, Any] = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": engine_id,
        "remote_host": "127.0.0.1",
        "remote_port": port,
        "tp_size": tp,
        "remote_block_ids": [[1, 2, 3]] if low >= (0, 18, 0) else [1, 2, 3],
    }
    if low >= (0, 13, 0):
        fields["remote_request_id"] = request_id
    if low >= (0, 21, 0):
        fields["remote_num_tokens"] = 40
    if low >= (0, 28, 0):
        fields["transfer_mode"] = "pull"
    if low >= (0, 29, 0):
        fields["pp_size"], fields["dcp_size"] = pp, 1
    if low >= (0, 33, 0):
        fields["remote_registration_generation"] = generation
    fields.update(override)
    return release_params(fields)


def make_job(
    params: ReleaseParams, rid: str, route: str = "/v1/chat/completions", **fields: Any
) -> ReleaseJob:
    now = time.monotonic()
    return ReleaseJob(
        request_id=fields.pop("request_id", rid),
        route=route,
        params=params,
        cause=fields.pop("cause", "rejected_4xx"),
        detected_at=now,
        deadline=now + 30,
        **fields,
    )
