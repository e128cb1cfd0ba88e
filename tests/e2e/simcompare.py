"""The simulators checked against the real engine: ``sim-decode --vllm-d`` beside real vLLM, per scenario.

For every scenario D answered itself, the same decode leg (route, body,
headers) goes to the decode simulator in "vLLM D" mode at the engines'
release, behind a simulated P whose pins never expire. What is compared:
the status, the error's ``type`` and ``param`` (or the code of an error event
in a 200 stream), and whether D notified P, which on the simulator's side is
P's own record of the request (freed by a notification, or still pinned)
and on the real side comes from real P's evidence in the sidecar run.

A difference must be fixed in the simulator or listed in ``KNOWN`` with the
reason; an unlisted difference fails the run.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any

import httpx

from sidecar.sim.decode import create_decode_app
from sidecar.sim.decode.config import DecodeSimConfig
from sidecar.sim.decode.nixl import VllmDHooks
from sidecar.sim.prefill import PrefillSimConfig, create_prefill_app
from sidecar.sim.servers import ServerThread, serve
from tests.e2e.evidence import Evidence, error_shape
from tests.e2e.scenarios import Limits, Scenario, client_body, decode_leg, headers_for, prompt

#: Differences between the simulator and real vLLM that are understood, by scenario key.
KNOWN: dict[str, str] = {}


@dataclass(frozen=True)
class Answer:
    """What one D answered a decode leg, and whether it notified P."""

    status: int
    error_type: str | None
    error_param: str | None
    stream_error: int | None
    notified: bool | None

    @classmethod
    def of(cls, ev: Evidence) -> Answer:
        return cls(ev.status, ev.error_type, ev.error_param, ev.stream_error, ev.d_notified)


def differences(real: Answer, sim: Answer) -> list[str]:
    """Each field on which the simulator answered otherwise than real vLLM (an unknown real
    ``notified``, when P's evidence could not tell, is not compared)."""
    return [
        f"{name}: vLLM {value!r}, simulator {getattr(sim, name)!r}"
        for name, value in asdict(real).items()
        if getattr(sim, name) != value and not (name == "notified" and value is None)
    ]


@dataclass
class Comparison:
    key: str
    real: Answer
    sim: Answer
    differences: list[str]
    known: str = ""

    @property
    def ok(self) -> bool:
        return not self.differences or bool(self.known)


@dataclass
class Simulators:
    p: ServerThread
    d: ServerThread


@contextmanager
def simulators(version: str, model: str, max_model_len: int) -> Iterator[Simulators]:
    """The P and "vLLM D" simulators at ``version``, on loopback, for the duration of the block."""
    p_config = PrefillSimConfig(
        port=0, vllm_version=version, lease=0, side_channel_port=0, model=model, log_level="warning"
    )
    d_config = DecodeSimConfig(
        port=0, version=version, model=model, max_model_len=max_model_len, vllm_d=True, log_size=1000
    )
    with (
        serve(create_prefill_app(p_config)) as p,
        serve(create_decode_app(d_config, VllmDHooks(version))) as d,
    ):
        yield Simulators(p, d)


def ask(sims: Simulators, scenario: Scenario, client: httpx.Client, limits: Limits) -> Answer:
    """The decode leg of ``scenario`` on the simulators: what D answered, and whether P was notified."""
    text, model = prompt(f"sim:{scenario.key}", 12), _served(sims, client)
    pin = {
        "model": model,
        "prompt": text,
        "max_tokens": 1,
        "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False},
    }
    pinned = client.post(sims.p.url + "/v1/completions", json=pin)
    pinned.raise_for_status()
    params: dict[str, Any] = pinned.json()["kv_transfer_params"]
    content = decode_leg(client_body(scenario, model, text, limits), params)
    headers = headers_for(scenario, f"sim-{scenario.key}-{time.time_ns()}")
    with client.stream("POST", sims.d.url + scenario.route, content=content, headers=headers) as response:
        raw = response.read()
    shape = error_shape(raw)
    notified = _notified(sims, client, str(params["remote_request_id"]))
    return Answer(
        response.status_code, shape.type, shape.param, shape.code if shape.in_stream else None, notified
    )


def _served(sims: Simulators, client: httpx.Client) -> str:
    return str(client.get(sims.d.url + "/v1/models").json()["data"][0]["id"])


def _notified(sims: Simulators, client: httpx.Client, request_id: str, window: float = 2.0) -> bool:
    """Whether the simulated P freed the request by a notification within ``window`` seconds."""
    deadline = time.monotonic() + window
    while time.monotonic() < deadline:
        state = client.get(sims.p.url + "/sim/requests/" + request_id).json()
        if state.get("freed_by") == "notification":
            return True
        time.sleep(0.05)
    return False


def compare(
    sims: Simulators, scenario: Scenario, real: Evidence, client: httpx.Client, limits: Limits
) -> Comparison:
    """One scenario's real answer beside the simulator's."""
    real_answer, sim_answer = Answer.of(real), ask(sims, scenario, client, limits)
    found = differences(real_answer, sim_answer)
    return Comparison(
        scenario.key, real_answer, sim_answer, found, KNOWN.get(scenario.key, "") if found else ""
    )


def comparable(scenario: Scenario) -> bool:
    """Scenarios where D itself answered (not the sidecar's 413, not D down)."""
    return not scenario.oversize and not scenario.d_down
