"""A vLLM decode node's (D) side of the NIXL protocol, for tests and the decode simulator.

``DecodeClient(version)`` handshakes every P worker named by a request's
``kv_transfer_params`` the way D of that release does (vLLM's listener,
handshake request and reply, metadata and rank addressing: per-worker ports or
one scheduler port, raw or msgpack requests, one or two reply frames, bare
metadata or the 0.13.0+ payload envelope), adds each worker's agent to its own
NIXL agent and sends the "done reading" notification: ``<id>`` on 0.9.0,
``<id>:1`` after. Handshakes are cached per P engine and redone when
``remote_registration_generation`` grows (0.33.0). It shares no wire code with
the prefill simulator, so the two check each other. The NIXL agent and the ZMQ
sockets live in one dedicated thread; the async methods only wait on it. The
agent runs without NIXL's progress thread (it busy-spins a core); instead the
client's thread calls ``get_new_notifs()`` every couple of milliseconds between
jobs, which is what pushes queued notifications out, and once more for a moment
before closing."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgspec
import zmq

from sidecar.sim.prefill.release import VersionKey, parse_version

logger = logging.getLogger("sidecar.sim.dclient")

T = TypeVar("T")
GET_META_MSG = b"get_meta_msg"
_TICK = 0.002  # seconds between progress calls while idle
_FLUSH = 0.1  # seconds of progress before the agent is dropped
_DECODER = msgspec.msgpack.Decoder()


class HandshakeError(RuntimeError):
    """P's side channel did not answer, or answered something unusable."""


class NotifyError(RuntimeError):
    """NIXL refused to deliver a notification (P's agent gone, for instance)."""


class _MetadataView(msgspec.Struct):
    """The ``NixlAgentMetadata`` fields D reads (every release has them)."""

    engine_id: str
    agent_metadata: bytes
    tp_size: int | None = None  # 0.9.1 only


class _PayloadView(msgspec.Struct):
    """``NixlHandshakePayload`` (0.13.0+)."""

    compatibility_hash: str
    agent_metadata_bytes: bytes


_METADATA = msgspec.msgpack.Decoder(_MetadataView)
_PAYLOAD = msgspec.msgpack.Decoder(_PayloadView)


@dataclass(frozen=True, slots=True)
class Target:
    """Where a request's P lives, read from its ``kv_transfer_params``."""

    host: str
    port: int
    engine_id: str
    tp_size: int | None
    pp_size: int
    generation: int | None

    @classmethod
    def from_params(cls, params: Mapping[str, Any]) -> Target:
        """Raises ``KeyError``/``TypeError`` on params D could not use either."""
        return cls(
            host=str(params["remote_host"]),
            port=int(params["remote_port"]),
            engine_id=str(params["remote_engine_id"]),
            tp_size=params.get("tp_size"),
            pp_size=int(params.get("pp_size") or 1),
            generation=params.get("remote_registration_generation"),
        )


@dataclass
class _Remote:
    generation: int | None
    agents: dict[tuple[int, int], str] = field(default_factory=dict)  # (pp, tp) -> name


_Job = tuple[Callable[[], Any], "concurrent.futures.Future[Any]"]


class _PumpThread:
    """Runs submitted calls one at a time and calls ``idle`` between them."""

    def __init__(self, idle: Callable[[], None]) -> None:
        self._idle = idle
        self._jobs: queue.Queue[_Job | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="dclient-nixl", daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._jobs.put((fn, future))
        return future

    def shutdown(self) -> None:
        self._jobs.put(None)
        self._thread.join()

    def _run(self) -> None:
        while True:
            try:
                job = self._jobs.get(timeout=_TICK)
            except queue.Empty:
                self._idle()
                continue
            if job is None:
                return
            fn, future = job
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as exc:  # handed to the awaiting caller
                    future.set_exception(exc)


class DecodeClient:
    """One D engine's NIXL agent, talking to any number of P engines."""

    def __init__(self, vllm_version: str, *, timeout: float = 5.0, tp_size: int | None = None) -> None:
        self.version: VersionKey = parse_version(vllm_version)
        self.timeout = timeout
        self.default_tp_size = tp_size  # for 0.9.0/0.9.1 params, which carry no tp_size
        self.name = str(uuid.uuid4())
        self._agent: Any = None
        self._pump: _PumpThread | None = None
        self._ctx: zmq.Context[zmq.Socket[bytes]] | None = None
        self._remotes: dict[tuple[str, int, str], _Remote] = {}

    async def __aenter__(self) -> DecodeClient:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _call(self, fn: Callable[..., T], *args: Any) -> T:
        if self._pump is None:
            raise RuntimeError("DecodeClient is not started")
        return await asyncio.wrap_future(self._pump.submit(lambda: fn(*args)))

    async def start(self) -> None:
        """Start the client's thread and create the NIXL agent in it."""
        self._pump = _PumpThread(self._progress)
        try:
            await self._call(self._start)
        except BaseException:
            await self.close()
            raise

    async def close(self) -> None:
        """Flush, drop remote agents, the agent and the ZMQ context; join the thread."""
        pump, self._pump = self._pump, None
        if pump is None:
            return
        try:
            await asyncio.wrap_future(pump.submit(self._close))
        finally:
            await asyncio.to_thread(pump.shutdown)

    async def handshake(
        self, params: Mapping[str, Any], *, force: bool = False
    ) -> dict[tuple[int, int], str]:
        """P's agent names by (pp_rank, tp_rank), handshaking if not cached."""
        return await self._call(self._handshake, Target.from_params(params), force)

    async def notify(self, params: Mapping[str, Any], message: bytes) -> int:
        """Send ``message`` to every P worker of ``params``; returns how many were sent."""
        return await self._call(self._notify, Target.from_params(params), message)

    async def release(self, params: Mapping[str, Any], request_id: str | None = None) -> bytes:
        """Send the release notification D sends after reading; returns the message."""
        message = self.release_message(params, request_id)
        await self.notify(params, message)
        return message

    def release_message(self, params: Mapping[str, Any], request_id: str | None = None) -> bytes:
        """``<id>`` (0.9.0) or ``<id>:1``; ``<id>`` is ``remote_request_id`` from 0.13.0.

        Before 0.13.0 P's id equals D's own engine request id; pass it as
        ``request_id`` (``cmpl-<x-request-id>-0`` or ``chatcmpl-<x-request-id>``).
        """
        rid = params.get("remote_request_id") if self.version >= (0, 13, 0) else None
        rid = rid or request_id
        if not rid:
            raise ValueError("no remote_request_id in params and no request_id given")
        return rid.encode() if self.version < (0, 9, 1) else f"{rid}:1".encode()

    # -- in the client's thread ------------------------------------------------

    def _start(self) -> None:
        from nixl_cu12._api import nixl_agent, nixl_agent_config

        self._agent = nixl_agent(self.name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
        self._ctx = zmq.Context()

    def _progress(self) -> None:
        if self._agent is None:
            return
        try:
            self._agent.get_new_notifs()  # drives UCX: queued notifications go out
        except Exception:
            logger.debug("NIXL progress call failed", exc_info=True)

    def _close(self) -> None:
        deadline = time.monotonic() + _FLUSH
        while self._agent is not None and time.monotonic() < deadline:
            self._progress()
            time.sleep(_TICK)
        for remote in self._remotes.values():
            self._forget_agents(remote)
        self._remotes.clear()
        self._agent = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    def _forget_agents(self, remote: _Remote) -> None:
        for name in remote.agents.values():
            try:
                self._agent.remove_remote_agent(name)
            except Exception:  # already gone on P's side: nothing to undo
                logger.debug("remove_remote_agent(%s) failed", name, exc_info=True)

    def _notify(self, target: Target, message: bytes) -> int:
        agents = self._handshake(target, False)
        for name in agents.values():
            try:
                self._agent.send_notif(name, message)
            except Exception as exc:
                self._drop(target)  # the next call handshakes again
                raise NotifyError(f"send_notif to {name} failed: {exc}") from exc
        return len(agents)

    def _drop(self, target: Target) -> None:
        remote = self._remotes.pop((target.host, target.port, target.engine_id), None)
        if remote is not None:
            self._forget_agents(remote)

    def _handshake(self, target: Target, force: bool) -> dict[tuple[int, int], str]:
        key = (target.host, target.port, target.engine_id)
        cached = self._remotes.get(key)
        stale = cached is not None and (target.generation or 0) > (cached.generation or 0)
        if cached is not None and not force and not stale:
            return dict(cached.agents)
        if cached is not None:
            self._drop(target)
        remote = _Remote(target.generation)
        remote.agents = self._fetch_agents(target)
        self._remotes[key] = remote
        return dict(remote.agents)

    def _fetch_agents(self, target: Target) -> dict[tuple[int, int], str]:
        agents: dict[tuple[int, int], str] = {}
        tp_size = target.tp_size or self.default_tp_size
        shared = self._socket(target, 0) if self.version >= (0, 14, 0) else None
        try:
            for pp_rank in range(target.pp_size):
                tp_rank = 0
                while tp_rank < (tp_size or 1):
                    meta = self._query(target, shared, pp_rank, tp_rank)
                    tp_size = tp_size or meta.tp_size or 1  # 0.9.1: P says its TP size
                    name = self._agent.add_remote_agent(meta.agent_metadata)
                    agents[(pp_rank, tp_rank)] = name.decode() if isinstance(name, bytes) else name
                    tp_rank += 1
        finally:
            if shared is not None:
                shared.close(linger=0)
        return agents

    def _socket(self, target: Target, tp_rank: int) -> zmq.Socket[bytes]:
        assert self._ctx is not None, "start() first"
        per_worker = self.version < (0, 11, 1)  # P listens on base + tp_rank
        port = target.port + tp_rank if per_worker else target.port
        sock = self._ctx.socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, int(self.timeout * 1000))
        host = f"[{target.host}]" if ":" in target.host else target.host
        if ":" in target.host:
            sock.setsockopt(zmq.IPV6, 1)
        sock.connect(f"tcp://{host}:{port}")
        return sock

    def _query(
        self, target: Target, shared: zmq.Socket[bytes] | None, pp_rank: int, tp_rank: int
    ) -> _MetadataView:
        sock = shared or self._socket(target, tp_rank)
        try:
            sock.send(self._request(pp_rank, tp_rank))
            frames = sock.recv_multipart()
        except zmq.Again as exc:
            where = f"{target.host}:{target.port} rank ({pp_rank}, {tp_rank})"
            raise HandshakeError(f"no handshake reply from {where} in {self.timeout}s") from exc
        finally:
            if shared is None:
                sock.close(linger=0)
        meta = self._decode(frames)
        if self.version >= (0, 10, 0) and meta.engine_id != target.engine_id:
            raise HandshakeError(f"engine {meta.engine_id!r} answered for {target.engine_id!r}")
        return meta

    def _request(self, pp_rank: int, tp_rank: int) -> bytes:
        if self.version < (0, 11, 1):
            return GET_META_MSG
        if self.version < (0, 26, 0):
            return msgspec.msgpack.encode([GET_META_MSG, tp_rank])
        return msgspec.msgpack.encode([GET_META_MSG, pp_rank, tp_rank])

    def _decode(self, frames: list[bytes]) -> _MetadataView:
        expected = 2 if self.version >= (0, 26, 0) else 1
        if len(frames) != expected:
            raise HandshakeError(f"{len(frames)} reply frames, expected {expected}")
        try:
            if expected == 2 and not isinstance(_DECODER.decode(frames[1]), float):
                raise HandshakeError("second reply frame is not a msgpack float")
            body = frames[0]
            if self.version >= (0, 13, 0):
                body = _PAYLOAD.decode(body).agent_metadata_bytes
            return _METADATA.decode(body)
        except msgspec.DecodeError as exc:
            raise HandshakeError(f"undecodable handshake reply: {exc}") from exc
