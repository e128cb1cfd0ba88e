"""The fault scenarios' cluster: P and "vLLM D" simulators, fault gates, an in-process sidecar.

``backends()`` starts, once per session, the prefill simulator (vLLM 0.34.0,
TP 2, real NIXL agents, a lease of 0 so only a notification ever frees a
block) and the decode simulator in "vLLM D" mode (it notifies P over NIXL for
what it admits and, having vLLM's own fix, for what its handler rejects or
sees cancelled). Each scenario then starts its own sidecar (``sidecar()``,
release ``nixl``) in front of D or of a ``FaultGate`` in front of D, and
sends P->D flows: ``pin`` runs the prefill leg on P, ``decode`` sends the
decode leg of one request ``Kind`` through the sidecar and records what the
client saw as a ``Sent``. Flows whose P side channel should go through a gate
get ``via(params, gate)``: the router hands D (and so the sidecar) P's
address, so a gate there sits between the decode pod and P.
"""

from __future__ import annotations

import itertools
import secrets
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import httpx

from sidecar.sim.decode import create_decode_app
from sidecar.sim.decode.config import DecodeSimConfig
from sidecar.sim.decode.nixl import VllmDHooks
from sidecar.sim.prefill import PrefillSimConfig, create_prefill_app
from sidecar.sim.servers import ServerThread, serve
from tests.faults.evidence import InProcessView, LogWatch, watching
from tests.faults.gate import FaultGate
from tests.faults.invariants import Fate, InvariantChecker, Observed, Report, Truth
from tests.support.runner import Sidecar, run_sidecar

VERSION = "0.34.0"
TP = 2
MODEL = "sim-prefill"
MAX_MODEL_LEN = 40  # D's, in words
PIN_WORDS = 16  # one block on P

Kind = Literal[
    "reject",  # 400 from D's request validation, before its handler: the sidecar's to release
    "reject_handler",  # 400 from D's handler (prompt too long): D's own fix releases it
    "admit",  # 200, D reads and notifies P
    "stream",  # 200 stream, D admits
    "drop",  # 200 stream that D cuts after two events (D admitted it)
    "stream_error",  # 200 stream opening with a 400 error event (engine admission failed)
    "slow",  # D waits ``slow`` seconds in its handler before answering (admits then)
]


class Server(Protocol):
    """Where a simulator answers HTTP (a ``ServerThread``, or a child process)."""

    @property
    def url(self) -> str: ...


@dataclass
class Backends:
    """The simulators shared by a session's scenarios."""

    p: Server
    d: ServerThread
    d_app: Any

    @property
    def side_channel_port(self) -> int:
        return int(httpx.get(self.p.url + "/stats").json()["side_channel_port"])


@contextmanager
def backends(event_delay: float = 0.05, stream_events: int = 8) -> Iterator[Backends]:
    """P (TP 2, never-expiring pins) and "vLLM D" on loopback, for the duration of the block."""
    p_config = PrefillSimConfig(
        port=0,
        vllm_version=VERSION,
        tp=TP,
        num_blocks=16384,
        lease=0,
        side_channel_port=0,
        model=MODEL,
        log_level="warning",
    )
    d_config = DecodeSimConfig(
        port=0,
        version=VERSION,
        model=MODEL,
        max_model_len=MAX_MODEL_LEN,
        stream_events=stream_events,
        event_delay=event_delay,
        log_size=200_000,
        log_params=True,  # test_d_faults reads P's request id from D's log
        vllm_d=True,
    )
    d_app = create_decode_app(d_config, VllmDHooks(VERSION))
    with serve(create_prefill_app(p_config)) as p, serve(d_app) as d:
        yield Backends(p, d, d_app)


SIDECAR_DEFAULTS: dict[str, Any] = {
    "release": "nixl",
    "prefill_allow": ("127.0.0.1",),
    "vllm_version": VERSION,  # D may be down: never depend on its /version
    "release_deadline": 10.0,
    "handshake_timeout": 1.0,
    "release_retry_initial": 0.05,
    "release_retry_max": 0.2,
    "log_format": "text",
    # The scenarios talk to the sidecar directly: nothing in front retries its answers on another
    # pod, so D unreachable (503) is released (tests/faults/test_mesh_retries.py has the proxies).
    "retried_statuses": ("none",),
}


@contextmanager
def sidecar(decode_url: str, **settings: Any) -> Iterator[Sidecar]:
    """A sidecar (release ``nixl``) in front of ``decode_url`` with the scenario's settings."""
    with run_sidecar(decode_url, **{**SIDECAR_DEFAULTS, **settings}) as sc:
        yield sc


@dataclass
class Sent:
    """One flow as the client saw it."""

    request_id: str  # x-request-id (D's log and the sidecar's decisions use it)
    p_request_id: str  # the id P pinned the blocks under
    kind: Kind
    status: int = 0  # 0: the client got no status (it left, or the connection broke)
    body: bytes = b""
    sidecar_answered: bool = False  # the error body is the sidecar's own, not D's
    broken: bool = False  # the body ended with a transport error
    seconds: float = 0.0  # from sending the decode leg to the end of the answer
    error: str = ""  # the client's transport error, if any
    params: dict[str, Any] = field(default_factory=dict)


class Flows:
    """Pins on P and decode legs through a sidecar, with unique request ids."""

    def __init__(self, backends: Backends, prefix: str) -> None:
        self.backends = backends
        self.prefix = f"{prefix}-{secrets.token_hex(3)}"
        self._ids = itertools.count()
        # Dropped after 1 s idle, before a server's 5 s keep-alive closes them (a reset on reuse).
        self.client = httpx.Client(timeout=30, limits=httpx.Limits(keepalive_expiry=1.0))
        self.sent: list[Sent] = []

    def close(self) -> None:
        self.client.close()

    def next_id(self) -> str:
        return f"{self.prefix}-{next(self._ids):05d}"

    def pin(self, request_id: str | None = None) -> tuple[str, dict[str, Any]]:
        """The router's prefill leg on P: P pins one block and answers kv_transfer_params."""
        request_id = request_id or self.next_id()
        body = {
            "model": MODEL,
            "prompt": " ".join(["tok"] * PIN_WORDS),
            "max_tokens": 1,
            "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False},
        }
        response = self.client.post(
            self.backends.p.url + "/v1/completions", json=body, headers={"x-request-id": request_id}
        )
        assert response.status_code == 200, response.text
        params: dict[str, Any] = response.json()["kv_transfer_params"]
        return request_id, params

    def decode(
        self,
        url: str,
        kind: Kind,
        *,
        gate: FaultGate | None = None,
        slow: float = 0.0,
        timeout: float = 30.0,
        pinned: tuple[str, dict[str, Any]] | None = None,
        on_first_chunk: Callable[[], None] | None = None,
    ) -> Sent:
        """Pin (unless ``pinned``), then send the decode leg of ``kind`` to ``url``.

        ``on_first_chunk`` runs (in this thread) once the first body bytes arrived.
        """
        request_id, params = pinned or self.pin()
        if gate is not None:
            params = via(params, gate)
        sent = Sent(request_id, str(params["remote_request_id"]), kind, params=params)
        self.sent.append(sent)
        headers = {"x-request-id": request_id}
        started = time.monotonic()
        try:
            with self.client.stream(
                "POST",
                url + "/v1/completions",
                json=decode_body(kind, params, slow),
                headers=headers,
                timeout=timeout,
            ) as response:
                sent.status = response.status_code
                chunks: list[bytes] = []
                try:
                    for chunk in response.iter_raw():
                        if not chunks and on_first_chunk is not None:
                            on_first_chunk()
                        chunks.append(chunk)
                except httpx.TransportError as exc:
                    sent.broken, sent.error = True, repr(exc)
                sent.body = b"".join(chunks)
        except httpx.TransportError as exc:
            sent.broken, sent.error = True, repr(exc)
        sent.seconds = time.monotonic() - started
        sent.sidecar_answered = sent.status >= 400 and b"decode server" in sent.body
        return sent


def decode_body(kind: Kind, params: dict[str, Any], slow: float = 0.0) -> dict[str, Any]:
    """The decode leg's body for ``kind`` (see ``Kind``)."""
    body: dict[str, Any] = {
        "model": MODEL,
        "prompt": "tok tok tok",
        "max_tokens": 4,
        "kv_transfer_params": params,
    }
    if kind == "reject":
        body["max_tokens"] = "x"
    elif kind == "reject_handler":
        body["prompt"] = " ".join(["tok"] * (MAX_MODEL_LEN * 2))
    elif kind in ("stream", "drop", "stream_error"):
        body["stream"] = True
        marker = {"drop": " [[drop-mid-stream]]", "stream_error": " [[stream-error:400]]"}.get(kind, "")
        body["prompt"] += marker
    elif kind == "slow":
        body["prompt"] += f" [[slow-headers:{slow}]]"
    return body


def via(params: dict[str, Any], gate: FaultGate) -> dict[str, Any]:
    """``params`` with P's side channel reached through ``gate``."""
    return {**params, "remote_port": gate.port}


@dataclass
class Scene:
    """One scenario: its sidecar, the flows it sends, and the invariant checker."""

    backends: Backends
    sc: Sidecar
    watch: LogWatch
    view: InProcessView
    checker: InvariantChecker
    flows: Flows

    def observe(self, sent: Sent, expected: Fate | None = None, **options: Any) -> Observed:
        options.setdefault("note", sent.error)
        return Observed(
            sent.request_id, sent.p_request_id, sent.status, sent.sidecar_answered, expected, **options
        )

    def check(self, observed: list[Observed], **options: Any) -> Report:
        return self.checker.check(observed, **options).verify()

    def sample(self, name: str, **labels: str) -> float:
        return self.sc.sample(name, **labels)

    def releases(self) -> dict[str, float]:
        """``kvr_releases_total`` by result and the NIXL errors by reason (for failure messages)."""
        metrics = self.view.metrics()
        return {
            k: v for k, v in metrics.items() if k.startswith(("kvr_releases_total", "kvr_nixl_errors_total"))
        }


@contextmanager
def scene(cluster: Backends, decode_url: str, prefix: str, **settings: Any) -> Iterator[Scene]:
    """A fresh sidecar in front of ``decode_url``, watched, with baselines taken."""
    with sidecar(decode_url, **settings) as sc, watching() as watch:
        view = InProcessView(sc, watch)
        truth = Truth(cluster.p.url, cluster.d.url, VERSION)
        checker = InvariantChecker(truth, view, ranks=TP)
        flows = Flows(cluster, prefix)
        try:
            checker.begin()
            yield Scene(cluster, sc, watch, view, checker, flows)
        finally:
            flows.close()
            truth.close()
