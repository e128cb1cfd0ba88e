"""vLLM's P-side NIXL code, read out of a vLLM wheel and run as P on real NIXL agents.

The wheel of a release (``pip download --no-deps vllm==X``, cached by ``tests.conformance.wheels``;
never vendored) holds the NIXL connector's P-side pieces: the ``NixlAgentMetadata`` /
``NixlHandshakePayload`` classes, the side-channel listener (and, from 0.11.1, the scheduler's
``set_xfer_handshake_metadata`` that encodes and serves the metadata), the worker's notification
handler ``_get_new_notifs`` and the lease expiry (inside ``get_finished`` before 0.31.0,
``_reap_expired_send_leases`` after). Only those functions are compiled (with ``ast``), into a
module whose vLLM imports are small stubs, so nothing pulls in torch. ``PProcess`` runs them in a
child process ("P") on real NIXL agents, created through ``nixl._api`` as vLLM does (a shim maps it
to ``nixl_cu12``); ``job``, ``p_params`` and ``releaser`` are the sidecar's side of a release to it.

Run as ``python vllm_p.py serve ...`` this file is P itself; the test suite's imports come after
that entry point, so the child needs none of them.
"""

from __future__ import annotations
import __future__ as future

import argparse
import ast
import asyncio
import collections
import contextlib
import dataclasses
import itertools
import json
import logging
import os
import queue
import subprocess
import sys
import threading
import time
import types
import typing
import uuid
import zipfile
from pathlib import Path
from typing import Any

CONNECTOR = "vllm/distributed/kv_transfer/kv_connector/"
# The NIXL connector (a single file until 0.19.x, a package from 0.20.0) and its helpers.
SOURCES = ("v1/nixl_connector.py", "v1/nixl/", "utils.py", "v1/base.py")
VERSIONS = [
    v
    for v in os.environ.get("KVR_CONFORMANCE_VLLM", "0.34.0,0.33.0,0.29.0,0.21.0,0.13.0,0.11.0").split(",")
    if v
]


# ============================================================================================
# P: vLLM's P-side code, extracted from the wheel and run on real NIXL agents (child process)
# ============================================================================================


class VllmSource:
    """The connector's Python files from a wheel, indexed by class and function with ``ast``."""

    def __init__(self, wheel: Path) -> None:
        with zipfile.ZipFile(wheel) as archive:
            names = [
                n
                for n in archive.namelist()
                if n.endswith(".py")
                and n.removeprefix(CONNECTOR).startswith(SOURCES)
                and n.startswith(CONNECTOR)
            ]
            self.files = {n: archive.read(n).decode() for n in names}
        self.trees = {name: ast.parse(text) for name, text in self.files.items()}

    def classes(self, name: str) -> list[ast.ClassDef]:
        return [
            n for t in self.trees.values() for n in t.body if isinstance(n, ast.ClassDef) and n.name == name
        ]

    def function(self, name: str) -> ast.FunctionDef:
        found = [
            n
            for t in self.trees.values()
            for n in t.body
            if isinstance(n, ast.FunctionDef) and n.name == name
        ]
        assert found, f"no module-level {name} in the wheel"
        return found[0]

    def method(self, name: str, kind: str) -> ast.FunctionDef | None:
        """``name`` as defined by the pull-side Worker/Scheduler class (not push, not abstract)."""
        found = []
        for tree in self.trees.values():
            for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
                if kind not in cls.name or "Push" in cls.name:
                    continue
                for node in cls.body:
                    if isinstance(node, ast.FunctionDef) and node.name == name and not _abstract(node):
                        found.append((("Pull" in cls.name), node))
        found.sort(key=lambda item: item[0], reverse=True)  # the pull subclass overrides the base
        return found[0][1] if found else None

    def constant(self, name: str) -> ast.stmt:
        for tree in self.trees.values():
            for node in tree.body:
                if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets):
                    return node
                if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", None) == name:
                    return node
        raise KeyError(name)


def _abstract(node: ast.FunctionDef) -> bool:
    body = [n for n in node.body if not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))]
    return len(body) == 1 and isinstance(body[0], ast.Raise)


def _undecorated(node: ast.FunctionDef) -> ast.FunctionDef:
    copy = ast.FunctionDef(
        name=node.name, args=node.args, body=node.body, decorator_list=[], returns=node.returns
    )
    if sys.version_info >= (3, 12):
        copy.type_params = []
    return ast.fix_missing_locations(ast.copy_location(copy, node))


class _NoOp:
    """Stands in for stats objects: every attribute is a do-nothing method."""

    def __getattr__(self, name: str) -> Any:
        return lambda *args, **kwargs: None


def _make_zmq_socket(ctx: Any, path: str, socket_type: Any, bind: bool | None = None, **_: Any) -> Any:
    """vllm.utils.make_zmq_socket, reduced to what the side channel uses."""
    import zmq

    sock = ctx.socket(socket_type)
    if socket_type == zmq.ROUTER:
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.setsockopt(zmq.SNDHWM, 0)
    if bind if bind is not None else socket_type == zmq.ROUTER:
        sock.bind(path)
    else:
        sock.connect(path)
    return sock


def _make_zmq_path(scheme: str, host: str, port: int | None = None) -> str:
    return f"{scheme}://{host}" if port is None else f"{scheme}://{host}:{port}"


class _Emitter(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        emit({"log": record.levelname, "msg": record.getMessage()})


_PRINT_LOCK = threading.Lock()


def emit(event: dict[str, Any]) -> None:
    with _PRINT_LOCK:
        sys.stdout.write("EVENT " + json.dumps(event) + "\n")
        sys.stdout.flush()


def build_module(source: VllmSource, port: int) -> types.ModuleType:
    """Compile the P-side pieces into one module whose vLLM imports are stubs."""
    import msgspec
    import zmq

    module = types.ModuleType("vllm_p_side")
    sys.modules[module.__name__] = module
    logger = logging.getLogger("vllm_p_side")
    logger.addHandler(_Emitter())
    logger.setLevel(logging.DEBUG)
    logger.propagate = False
    stubs: dict[str, Any] = {
        "msgspec": msgspec, "zmq": zmq, "time": time, "threading": threading, "contextlib": contextlib,
        "itertools": itertools, "logger": logger, "defaultdict": collections.defaultdict,
        "dataclass": dataclasses.dataclass, "field": dataclasses.field, "ABC": object,
        "Any": Any, "Optional": typing.Optional, "Union": typing.Union, "Iterator": typing.Iterator,
        "make_zmq_socket": _make_zmq_socket, "make_zmq_path": _make_zmq_path,
        "ReqId": str, "EngineId": str, "TransferHandle": int, "Transfer": tuple,
        "envs": types.SimpleNamespace(
            VLLM_NIXL_SIDE_CHANNEL_HOST="127.0.0.1", VLLM_NIXL_SIDE_CHANNEL_PORT=port,
            VLLM_NIXL_ABORT_REQUEST_TIMEOUT=480,
        ),
    }  # fmt: skip
    module.__dict__.update(stubs)
    nodes: list[ast.stmt] = [source.constant("GET_META_MSG")]
    nodes += source.classes("KVConnectorHandshakeMetadata")[:1]
    nodes += source.classes("NixlAgentMetadata")[:1] + source.classes("NixlHandshakePayload")[:1]
    nodes.append(source.function("zmq_ctx"))
    for name, kind in PIECES:
        node = source.method(name, kind)
        if node is not None:
            nodes.append(_undecorated(node))
    flags = future.annotations.compiler_flag  # annotations stay strings: no torch, no vllm types
    code = compile(
        ast.Module(body=nodes, type_ignores=[]), "<vllm P side>", "exec", flags=flags, dont_inherit=True
    )
    exec(code, module.__dict__)
    topology = source.method("tp_ratio", "Topology")
    if topology is not None:
        exec(
            compile(ast.Module(body=[_undecorated(topology)], type_ignores=[]), "<tp_ratio>", "exec"),
            module.__dict__,
        )
    return module


PIECES = [
    ("_nixl_handshake_listener", "Worker"),  # 0.9.x-0.11.0: one listener per worker
    ("_nixl_handshake_listener", "Scheduler"),  # 0.11.1+: one per engine
    ("set_xfer_handshake_metadata", "Scheduler"),
    ("_get_new_notifs", "Worker"),
    ("_handle_heartbeat", "Worker"),
    ("_pop_done_transfers", "Worker"),
    ("get_finished", "Worker"),
    ("_reap_expired_send_leases", "Worker"),
]

FIELD_VALUES: dict[str, Any] = {
    "kv_caches_base_addr": [0], "device_id": 0, "num_blocks": 16, "block_len": 4096, "block_lens": [4096],
    "block_strides": [4096], "kv_cache_layout": "HND", "block_size": 16, "ssm_sizes": (0, 0),
    "attn_backend_name": "FLASH_ATTN", "physical_blocks_per_logical_kv_block": 1,
}  # fmt: skip


DEVICE_STEPS = frozenset({"blocksize_post_process", "permute_device_kv", "sync_recved_kv_to_device"})


class _Inbox(set[str]):
    """``_failed_recv_reqs``: a set before 0.29.0, a queue after; always empty here."""

    def empty(self) -> bool:
        return not self

    def get_nowait(self) -> str:
        raise queue.Empty


class FakeTopology:
    def __init__(self, tp_size: int, tp_ratio: Any) -> None:
        self.tp_size = tp_size
        if tp_ratio is not None:
            self.tp_ratio = types.MethodType(tp_ratio, self)


class _Tap:
    """The worker's NIXL agent, reporting every notification it hands vLLM's code (in order)."""

    def __init__(self, agent: Any, rank: tuple[int, int]) -> None:
        self._agent, self._rank = agent, rank

    def get_new_notifs(self) -> dict[str, list[bytes]]:
        notifs: dict[str, list[bytes]] = self._agent.get_new_notifs()
        for messages in notifs.values():
            for message in messages:
                emit({"notif": message.decode(errors="replace"), "rank": list(self._rank)})
        return notifs

    def __getattr__(self, name: str) -> Any:
        return getattr(self._agent, name)


class PWorker:
    """The state a vLLM P worker's notification and expiry code touch, plus vLLM's methods."""

    def __init__(
        self, module: types.ModuleType, agent: Any, engine_id: str, rank: tuple[int, int], tp: int
    ) -> None:
        self.nixl_wrapper, self.engine_id, self.rank = _Tap(agent, rank), engine_id, rank
        self.tp_rank, self.world_size = rank[1], tp
        self._tp_size = {engine_id: tp}
        self._reqs_to_send: dict[str, float] = {}
        self._reqs_to_process: set[str] = set()
        self.consumer_notification_counts_by_req: collections.defaultdict[str, int] = collections.defaultdict(
            int
        )
        self.expected_consumer_notifications_by_req: dict[str, int] = {}
        self.xfer_stats = _NoOp()
        self.transfer_topo = self.kv_topo = FakeTopology(tp, module.__dict__.get("tp_ratio"))
        self.use_host_buffer = self.use_mla = self._is_hma_required = False
        self.enable_permute_local_kv = self.enable_heterogeneous_attn_post_process = False
        self._recving_transfers: dict[str, Any] = {}
        self._recving_metadata: dict[str, Any] = {}
        self._failed_recv_reqs = _Inbox()
        self._lease_extension = 20
        for name in ("_get_new_notifs", "_handle_heartbeat", "_pop_done_transfers", "get_finished"):
            if name in module.__dict__:
                setattr(self, name, types.MethodType(module.__dict__[name], self))
        reap = module.__dict__.get("_reap_expired_send_leases")
        self._reap = types.MethodType(reap, self) if reap is not None else None

    def __getattr__(self, name: str) -> Any:
        if name in DEVICE_STEPS or name.startswith(("_sync_device", "post_process")):
            return lambda *args, **kwargs: None  # device-side KV post-processing: nothing received
        raise AttributeError(f"P worker stub lacks {name!r}: extend PWorker for this vLLM release")

    def step(self) -> set[str]:
        """One engine step's sending side: notifications, then lease expiry."""
        if self._reap is not None:  # 0.31.0+: get_transfer_results runs exactly these two
            done: set[str] = self._get_new_notifs()
            self._reap(done)
            return done
        finished: set[str] = self.get_finished()[0]
        return finished

    def hold(self, request_id: str, ttl: float) -> None:
        """What P's request_finished + build_connector_meta leave on every worker."""
        self._reqs_to_send[request_id] = time.perf_counter() + ttl
        self._reqs_to_process.add(request_id)


class PScheduler:
    """The scheduler state ``set_xfer_handshake_metadata`` touches (0.11.1+)."""

    def __init__(self, module: types.ModuleType, port: int) -> None:
        self.side_channel_host, self.side_channel_port = "127.0.0.1", port
        self._stop_event = threading.Event()
        self._nixl_handshake_listener_t: threading.Thread | None = None
        self._handshake_data: dict[Any, bytes] = {}
        self._encoded_xfer_handshake_metadata: dict[Any, bytes] = {}
        self._registration_generation = 0
        self._nixl_handshake_listener = module.__dict__["_nixl_handshake_listener"]
        self.set_xfer_handshake_metadata = types.MethodType(
            module.__dict__["set_xfer_handshake_metadata"], self
        )


def agent_metadata(module: types.ModuleType, source: VllmSource, engine_id: str, blob: bytes, tp: int) -> Any:
    cls_node = source.classes("NixlAgentMetadata")[0]
    required = [
        n.target.id
        for n in cls_node.body
        if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name) and n.value is None
    ]
    values = dict(FIELD_VALUES, engine_id=engine_id, agent_metadata=blob, tp_size=tp)
    metadata = module.NixlAgentMetadata(**{name: values[name] for name in required})
    if hasattr(module, "NixlHandshakePayload"):  # 0.13.0+: what the worker hands the scheduler
        inner = module.msgspec.msgpack.Encoder().encode(metadata)
        return module.NixlHandshakePayload(compatibility_hash="0" * 64, agent_metadata_bytes=inner)
    return metadata


def serve(args: argparse.Namespace) -> None:
    """P: listeners + workers of one engine; commands on stdin, events on stdout."""
    import nixl_cu12._api as api

    shim = types.ModuleType("nixl")
    shim._api = api  # type: ignore[attr-defined]
    sys.modules["nixl"], sys.modules["nixl._api"] = shim, api
    from nixl._api import nixl_agent, nixl_agent_config  # as vLLM's worker does

    source = VllmSource(Path(args.wheel))
    module = build_module(source, args.port)
    ranks = [(pp, tp) for pp in range(args.pp) for tp in range(args.tp)]
    agents = {rank: nixl_agent(str(uuid.uuid4()), nixl_agent_config(backends=["UCX"])) for rank in ranks}
    payloads = {
        r: agent_metadata(module, source, args.engine_id, a.get_agent_metadata(), args.tp)
        for r, a in agents.items()
    }
    listeners: list[threading.Thread] = []
    if hasattr(module, "set_xfer_handshake_metadata"):
        listener_source = ast.unparse(source.method("_nixl_handshake_listener", "Scheduler"))  # type: ignore[arg-type]
        keyed_by_pp = "target_pp_rank" in listener_source
        scheduler = PScheduler(module, args.port)
        scheduler.set_xfer_handshake_metadata({(r if keyed_by_pp else r[1]): p for r, p in payloads.items()})
        assert scheduler._nixl_handshake_listener_t is not None
        listeners.append(scheduler._nixl_handshake_listener_t)
    else:  # one listener per TP worker on base_port + tp_rank
        for (_, tp), payload in payloads.items():
            ready = threading.Event()
            thread = threading.Thread(
                target=module._nixl_handshake_listener, args=(payload, ready, args.port, tp), daemon=True
            )
            thread.start()
            ready.wait()
            listeners.append(thread)
    workers = {rank: PWorker(module, agents[rank], args.engine_id, rank, args.tp) for rank in ranks}
    commands: queue.Queue[str] = queue.Queue()

    def read_commands() -> None:
        for line in sys.stdin:
            commands.put(line)

    threading.Thread(target=read_commands, daemon=True).start()
    emit({"ready": args.port, "agents": {f"{r[0]},{r[1]}": a.name for r, a in agents.items()}})
    while True:
        with contextlib.suppress(queue.Empty):
            line = commands.get(timeout=0.001).split()
            if not line or line[0] == "quit":
                return
            if line[0] == "hold":
                for worker in workers.values():
                    worker.hold(line[1], float(line[2]))
                emit({"held": line[1]})
            elif line[0] == "alive":
                emit({"alive": [t.is_alive() for t in listeners]})
            elif line[0] == "sync":  # every event of the steps before this one is out
                emit({"synced": line[1]})
        for rank, worker in workers.items():
            try:
                for request_id in worker.step():
                    emit({"finished": request_id, "rank": list(rank)})
            except Exception as exc:  # in vLLM this escapes the model step
                emit({"error": repr(exc), "rank": list(rank)})


# ============================================================================================
# The tests (pytest side)
# ============================================================================================


class PProcess:
    """The child process running vLLM's P code; events are collected by a reader thread."""

    def __init__(self, wheel: Path, tp: int, pp: int) -> None:
        self.tp, self.pp = tp, pp
        self.engine_id = f"p-{uuid.uuid4().hex[:8]}"
        self.port = free_port(tp)
        command = [
            sys.executable, __file__, "serve", "--wheel", str(wheel), "--tp", str(tp), "--pp", str(pp),
            "--port", str(self.port), "--engine-id", self.engine_id,
        ]  # fmt: skip
        self.proc = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
        )
        self.events: list[dict[str, Any]] = []
        self._changed = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()
        self.wait(lambda: any("ready" in e for e in self.events), 60, "P did not start")

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("EVENT "):
                with self._changed:
                    self.events.append(json.loads(line[6:]))
                    self._changed.notify_all()
        with self._changed:
            self.events.append({"exited": self.proc.poll()})
            self._changed.notify_all()

    def wait(self, done: Any, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        with self._changed:
            while not done():
                remaining = deadline - time.monotonic()
                if remaining <= 0 or any("exited" in e for e in self.events):
                    raise AssertionError(f"{what}; P events: {self.events[-20:]}")
                self._changed.wait(remaining)

    async def await_(self, done: Any, what: str, within: float = 10.0) -> None:
        await asyncio.to_thread(self.wait, done, within, what)

    def send(self, command: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()

    async def hold(self, request_id: str, ttl: float = 300.0) -> None:
        self.send(f"hold {request_id} {ttl}")
        await self.await_(lambda: {"held": request_id} in self.events, f"hold {request_id}")

    def finished(self, request_id: str) -> list[tuple[int, ...]]:
        return sorted(tuple(e["rank"]) for e in self.events if e.get("finished") == request_id)

    def logs(self, needle: str) -> list[str]:
        return [e["msg"] for e in self.events if "log" in e and needle in e["msg"]]

    def received(self, message: str) -> list[tuple[int, ...]]:
        """The ranks that handed ``message`` to vLLM's notification handler, once per arrival."""
        return sorted(tuple(e["rank"]) for e in self.events if e.get("notif") == message)

    async def settle(self) -> None:
        """Wait until the steps P is running now are over (their events are out)."""
        token = uuid.uuid4().hex
        self.send(f"sync {token}")
        await self.await_(lambda: {"synced": token} in self.events, "P's step loop answered")

    def stop(self) -> None:
        with contextlib.suppress(BrokenPipeError):
            self.send("quit")
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "serve":
    parser = argparse.ArgumentParser()
    parser.add_argument("command")
    for option in ("--wheel", "--engine-id"):
        parser.add_argument(option, required=True)
    for option in ("--tp", "--pp", "--port"):
        parser.add_argument(option, type=int, required=True)
    serve(parser.parse_args())
    sys.exit(0)

from prometheus_client import CollectorRegistry  # noqa: E402

from sidecar.config import Config  # noqa: E402
from sidecar.nixl.versions import WireProfile  # noqa: E402
from sidecar.release.base import ReleaseJob  # noqa: E402
from sidecar.release.nixl import NixlReleaser  # noqa: E402
from tests.conformance.vllm_source import spoken  # noqa: E402
from tests.support.fakes import release_params  # noqa: E402
from tests.support.ports import free_port  # noqa: E402


def job(version: str, p: PProcess, x_request_id: str, **changes: Any) -> ReleaseJob:
    """A release of the request P holds as ``p_request_id(version, x_request_id)``; ``changes``
    replace fields of its ``kv_transfer_params``."""
    now = time.monotonic()
    return ReleaseJob(
        request_id=x_request_id,
        route="/v1/chat/completions",
        params=release_params({**p_params(version, p, x_request_id), **changes}),
        cause="unreachable",  # D never answered: not D's own fix's to release
        detected_at=now,
        deadline=now + 30,
    )


def p_params(version: str, p: PProcess, x_request_id: str) -> dict[str, Any]:
    """``kv_transfer_params`` as P of ``version`` emits them for the request ``x_request_id``."""
    profile = WireProfile.for_version(spoken(version))
    assert profile is not None
    low = profile.low
    fields: dict[str, Any] = {
        "do_remote_prefill": True, "remote_engine_id": p.engine_id, "remote_host": "127.0.0.1",
        "remote_port": p.port, "tp_size": p.tp, "remote_block_ids": [[1, 2]] if low >= (0, 18, 0) else [1, 2],
    }  # fmt: skip
    if low >= (0, 13, 0):
        fields["remote_request_id"] = f"chatcmpl-{x_request_id}-0a1b2c3d"
    if low >= (0, 21, 0):
        fields["remote_num_tokens"] = 2
    if low >= (0, 28, 0):
        fields["transfer_mode"] = "pull"
    if low >= (0, 29, 0):
        fields["pp_size"], fields["dcp_size"] = p.pp, 1
    if low >= (0, 33, 0):
        fields["remote_registration_generation"] = 1
    return fields


def p_request_id(version: str, x_request_id: str) -> str:
    profile = WireProfile.for_version(spoken(version))
    assert profile is not None
    return (
        f"chatcmpl-{x_request_id}-0a1b2c3d"
        if profile.wire.has_remote_request_id
        else f"chatcmpl-{x_request_id}"
    )


async def releaser(version: str, reported: str = "") -> NixlReleaser:
    """The sidecar's releaser for P of ``version``, told the release ``reported`` (as D's
    ``/version`` would; default: ``version``)."""

    async def no_version() -> str | None:
        return None

    cfg = Config(
        vllm_version=reported or spoken(version), prefill_allow=("127.0.0.1/32",), handshake_timeout=5.0
    )
    r = NixlReleaser(cfg, no_version, CollectorRegistry())
    await r.start()
    return r
