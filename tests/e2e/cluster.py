"""The P and D of a run: the harness's own engines (tiny model, CPU build), or a user's.

A user's are given with ``--p-url`` and ``--d-url``.

``own_engines`` makes the model with the engines' Python, writes the plugin's
token file, picks loopback ports and starts P and D at once (start-up is
mostly each engine's own compilation and warm-up), then waits for both.
``given_engines`` only reads what the scenarios need from the user's P and D.
Either way ``calibrate`` picks a prompt longer than one KV block of P's
(asked of D's ``/tokenize``), so an admitted request reads more than a tail.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tests.e2e.engines import (
    Child,
    EngineFailed,
    EngineSpec,
    PeakMemory,
    Processes,
    pin_group,
    split_cores,
    start_engine,
    wait_healthy,
)
from tests.e2e.runner import LogSource, Target
from tests.e2e.scenarios import prompt
from tests.support.ports import free_port

MAKE_MODEL = Path(__file__).with_name("make_model.py")
LONG_PROMPT_TOKENS = 160  # over one block of 128 tokens (the CPU build's), under max_model_len - output


@dataclass
class Engines:
    """The P and D of a run; ``d`` is None when D is not the harness's to stop."""

    target: Target
    d: Child | None = None
    control_token_file: Path | None = None
    info: dict[str, Any] = field(default_factory=dict)
    memory: PeakMemory | None = None  # the harness's own engines: their peak memory
    more_d: list[tuple[str, Child]] = field(default_factory=list)  # other decode engines: URL, child
    keyed_d: tuple[str, str] | None = None  # a decode engine requiring an API key: its URL and key


def make_model(python: str, out: Path) -> float:
    """The tiny model and tokenizer, made by the engines' Python; the seconds it took."""
    started = time.monotonic()
    done = subprocess.run([python, str(MAKE_MODEL), str(out)], capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise EngineFailed(f"making the model failed:\n{done.stderr[-3000:]}")
    return time.monotonic() - started


def token_file(out: Path) -> Path:
    """The control endpoint's token, shared by D's plugin and the http sidecar (mode 0600)."""
    path = out / "control-token"
    path.write_text(secrets.token_hex(16))
    path.chmod(0o600)
    return path


def own_engines(
    processes: Processes,
    python: str,
    out: Path,
    lease: int,
    timeout: float,
    decoders: int = 1,
    keyed: bool = False,
) -> Engines:
    """Start P and ``decoders`` D engines (see the module docstring); ``EngineFailed`` if one does not
    come up. The first D is the target's; the others (``D2``...) share its cores. With ``keyed``, one
    more decode engine (``Dk``, on D's cores) requires an API key (``--api-key``): the smg mode's D."""
    model_seconds = make_model(python, out / "model")
    token = token_file(out)
    logs = out / "logs"
    p_cpus, d_cpus = split_cores(os.cpu_count() or 1)
    specs = [
        EngineSpec("P", python, out / "model", free_port(), free_port(), lease, logs / "p.log", cpus=p_cpus),
        *(
            EngineSpec(
                f"D{index + 1 if index else ''}",
                python,
                out / "model",
                free_port(),
                free_port(),
                lease,
                logs / f"d{index + 1 if index else ''}.log",
                token,
                cpus=d_cpus,
            )
            for index in range(decoders)
        ),
    ]
    if keyed:
        key = secrets.token_hex(16)
        specs.append(
            EngineSpec(
                "Dk",
                python,
                out / "model",
                free_port(),
                free_port(),
                lease,
                logs / "dk.log",
                cpus=d_cpus,
                api_key=key,
            )
        )
    children = [start_engine(processes, spec) for spec in specs]
    memory = PeakMemory(children).__enter__()
    started = {}
    try:
        for spec, child in zip(specs, children, strict=True):
            started[spec.role] = wait_healthy(child, spec.url + "/health", timeout)
    except BaseException:
        memory.__exit__()
        raise
    pinned = {
        spec.role: pin_group(child.process.pid, spec.cpus)
        for spec, child in zip(specs, children, strict=True)
        if spec.cpus
    }
    p, d = specs[:2]
    target = Target(p.url, d.url, "", float(lease), LogSource.of(children[0]))
    info = {"engines": "started by the harness", "model_seconds": round(model_seconds, 1)}
    info["engine_ready_seconds"] = {role: round(seconds, 1) for role, seconds in started.items()}
    info["engine_threads_pinned"] = pinned
    more = [
        (spec.url, child) for spec, child in zip(specs[2:], children[2:], strict=True) if not spec.api_key
    ]
    keyed_d = next(((spec.url, spec.api_key) for spec in specs if spec.api_key), None)
    return Engines(target, children[1], token, info, memory, more, keyed_d)


def given_engines(p_url: str, d_url: str, lease: float, p_log: str, token: str) -> Engines:
    """A user's P and D; their log (``--p-log``) and plugin token are optional."""
    source = None
    if p_log:
        path = Path(p_log)
        source = LogSource(lambda: path.stat().st_size, lambda offset: _read_from(path, offset))
    target = Target(p_url.rstrip("/"), d_url.rstrip("/"), "", lease, source)
    return Engines(target, None, Path(token) if token else None, {"engines": "given (--p-url, --d-url)"})


def _read_from(path: Path, offset: int) -> str:
    with path.open("rb") as handle:
        handle.seek(offset)
        return handle.read().decode(errors="replace")


def warm_up(target: Target, client: httpx.Client) -> float:
    """Plain requests to P and D, then one P/D exchange, before any scenario; the seconds it took.

    A fresh CPU engine answers its first requests several seconds late (one-time set-up on the
    first batches), long enough to outlive a short lease; and D's first read handshakes P. A
    cluster in service has done both long before, so the scenarios start from there.
    """
    started = time.monotonic()
    text = prompt("warm-up", target.long_prompt_words)
    plain = {"model": target.model, "prompt": text, "max_tokens": 8, "temperature": 0}
    for _ in range(2):
        client.post(target.p_url + "/v1/completions", json=plain).raise_for_status()
        client.post(target.d_url + "/v1/completions", json=plain, headers=target.d_headers).raise_for_status()
    pin = {
        **plain,
        "max_tokens": 1,
        "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False},
    }
    answer = client.post(target.p_url + "/v1/completions", json=pin)
    answer.raise_for_status()
    params = answer.json()["kv_transfer_params"]
    client.post(
        target.d_url + "/v1/completions",
        json={**plain, "kv_transfer_params": params},
        headers=target.d_headers,
    ).raise_for_status()
    return time.monotonic() - started


def calibrate(target: Target, client: httpx.Client) -> dict[str, Any]:
    """D's model, release and a long prompt's word count; what was found, for the report."""
    served = client.get(target.d_url + "/v1/models").json()["data"][0]
    target.model = str(served["id"])
    target.max_model_len = int(served.get("max_model_len") or 256)
    version = str(client.get(target.d_url + "/version").json().get("version", ""))
    words = 40
    tokens = 0
    while words < 400:
        text = prompt("calibrate", words)
        answer = client.post(target.d_url + "/tokenize", json={"model": target.model, "prompt": text})
        answer.raise_for_status()
        tokens = int(answer.json()["count"])
        if tokens >= LONG_PROMPT_TOKENS:
            break
        words += 10
    target.long_prompt_words = words
    return {"model": target.model, "vllm_version": version, "long_prompt": {"words": words, "tokens": tokens}}
