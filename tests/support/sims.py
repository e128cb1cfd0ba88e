"""The simulators as the tests drive them, and the requests clients send through them.

- ``p_stats`` and ``wait_stats``: P's ``/stats``, its record of every block, read and waited on
  (P's record is the ground truth of what was freed, and by whom).
- ``cluster``: P (real NIXL agents), D as vLLM D and the sidecar in front of D; ``prefill`` asks P
  for a request's ``kv_transfer_params``. ``pd``: the sidecar in router mode in front of D, with
  its P pool.
- ``chat``, ``completion``, ``messages``, ``generate``: request bodies as clients send them.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Protocol

import httpx

from sidecar.sim.decode import create_decode_app
from sidecar.sim.decode.config import DecodeSimConfig
from sidecar.sim.decode.nixl import VllmDHooks
from sidecar.sim.prefill import PrefillSimConfig, create_prefill_app
from sidecar.sim.servers import ServerThread, serve
from tests.support.runner import Sidecar, run_sidecar
from tests.support.until import until


class Served(Protocol):
    """Where a simulator answers HTTP (a ``ServerThread``, or a child process's address)."""

    @property
    def url(self) -> str: ...


def _url(p: Served | str) -> str:
    return p if isinstance(p, str) else p.url


def p_stats(p: Served | str, **client: Any) -> dict[str, Any]:
    """P's ``/stats`` (``p``: its server or base URL; ``client``: ``verify`` for TLS)."""
    result: dict[str, Any] = httpx.get(_url(p) + "/stats", timeout=5, **client).json()
    return result


def wait_stats(
    p: Served | str, check: Any, timeout: float = 30.0, poll: float = 0.01, **client: Any
) -> dict[str, Any]:
    """P's stats once ``check(stats)`` holds. ``timeout`` bounds a hang, it measures nothing: at
    load 14 on two cores a sent notification took over 10 s to be counted by P's NIXL agent."""
    seen: list[dict[str, Any]] = [{}]

    def current() -> dict[str, Any] | None:
        seen[0] = p_stats(p, **client)
        return seen[0] if check(seen[0]) else None

    found = until(current, "P's expected state", timeout, poll, state=lambda: seen[0])
    assert found is not None
    return found


@contextmanager
def cluster(
    version: str,
    tp: int,
    pp: int = 1,
    *,
    vllm_d: bool = True,
    lease: float = 0,
    d_version: str | None = None,
    d_settings: dict[str, Any] | None = None,
    **sidecar: Any,
) -> Iterator[tuple[ServerThread, ServerThread, Sidecar]]:
    p_config = PrefillSimConfig(
        port=0, vllm_version=version, tp=tp, pp=pp, num_blocks=256, lease=lease, side_channel_port=0
    )
    hooks = VllmDHooks(version) if vllm_d else None
    d_config = DecodeSimConfig(
        port=0, version=d_version or version, max_model_len=40, model="sim-prefill", **(d_settings or {})
    )
    settings: dict[str, Any] = {"release": "nixl", "prefill_allow": ("127.0.0.1",), **sidecar}
    with (
        serve(create_prefill_app(p_config)) as p,
        serve(create_decode_app(d_config, hooks)) as d,
        run_sidecar(d.url, **settings) as sc,
    ):
        yield p, d, sc


def prefill(p: ServerThread, request_id: str, words: int = 20) -> dict[str, Any]:
    """The router's prefill leg: P pins blocks and answers kv_transfer_params."""
    body = {
        "model": "sim-prefill",
        "prompt": " ".join(["tok"] * words),
        "max_tokens": 1,
        "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False},
    }
    response = httpx.post(p.url + "/v1/completions", json=body, headers={"x-request-id": request_id})
    assert response.status_code == 200, response.text
    params: dict[str, Any] = response.json()["kv_transfer_params"]
    assert params["do_remote_prefill"] is True
    return params


VERSION = "0.33.0"


@contextmanager
def pd(
    prefills: int = 1,
    *,
    static: bool = True,
    d_config: dict[str, Any] | None = None,
    p_config: dict[str, Any] | None = None,
    **sidecar: Any,
) -> Iterator[tuple[list[ServerThread], ServerThread, Sidecar]]:
    p_settings = {"vllm_version": VERSION, "tp": 2, "num_blocks": 64, "lease": 0, **(p_config or {})}
    p_apps = [
        create_prefill_app(PrefillSimConfig(port=0, side_channel_port=0, **p_settings))
        for _ in range(prefills)
    ]
    d_settings = {"port": 0, "version": VERSION, "max_model_len": 40, "model": "m", "log_params": True}
    d_settings.update(d_config or {})
    with (
        contextlib_stack(p_apps) as ps,
        serve(create_decode_app(DecodeSimConfig(**d_settings), VllmDHooks(VERSION))) as d,
    ):
        settings: dict[str, Any] = {"release": "nixl", "prefill_allow": ("127.0.0.1",), **sidecar}
        if static:
            settings.setdefault("prefill", tuple(p.url for p in ps))
        with run_sidecar(d.url, **settings) as sc:
            yield ps, d, sc


@contextmanager
def contextlib_stack(apps: list[Any]) -> Iterator[list[ServerThread]]:
    from contextlib import ExitStack

    with ExitStack() as stack:
        yield [stack.enter_context(serve(app)) for app in apps]


def chat(text: str, **extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": text}], "max_tokens": 4, **extra}


def completion(words: int, **extra: Any) -> dict[str, Any]:
    return {"model": "m", "prompt": " ".join(["tok"] * words), "max_tokens": 4, **extra}


def messages(text: str, **extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": text}], "max_tokens": 8, **extra}


def generate(tokens: int, **sampling: Any) -> dict[str, Any]:
    return {
        "model": "m",
        "token_ids": list(range(1, tokens + 1)),
        "sampling_params": {"max_tokens": 4, **sampling},
    }
