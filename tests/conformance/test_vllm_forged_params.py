"""Forged ``kv_transfer_params`` against vLLM's own P code: P's side channel stays up.

P is vLLM's P-side NIXL code read out of each release's wheel
(``vllm_p.PProcess``, real NIXL agents). From 0.11.1 vLLM's listener
thread ends on a request for a rank P does not have, and with it every later
handshake with that P (docs/security.md, "What a release asks of P"). For each
handshake form the sidecar speaks (``sidecar.nixl.versions``): one listener per
worker (0.11.0), the 2-element request (0.21.0, and 0.25.1, its last release),
the 3-element one (0.26.0, its first; 0.29.0, where pull reads ``pp_size``;
0.34.0), a forged ``tp_size``, a forged ``pp_size`` (where P reads it) and a
bogus engine id each leave the listener alive; so does a claim of more ranks
with P's true engine id once P's own parameters proved its ranks; and a true
release sent afterwards is freed on every rank.

Then the same through the processes users run, with their shipped defaults:
``serve --release nixl --prefill-allow <P>`` in front of a D that wants an API
key (a client without one is refused, and its request released), and
``pd-sidecar`` with ``KVR_PREFILL_ALLOW``, where a client's own parameters are
never released.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest

from sidecar.nixl import EngineMismatch, TopologyMismatch
from sidecar.nixl.versions import WireProfile
from sidecar.release.base import JobResult
from sidecar.sim.decode import create_decode_app
from sidecar.sim.decode.config import DecodeSimConfig
from sidecar.sim.servers import ServerThread, serve
from tests.conformance.vllm_p import PProcess, job, p_params, p_request_id, releaser
from tests.conformance.vllm_source import releases, spoken
from tests.conformance.wheels import fetch_wheel
from tests.support.ports import free_port
from tests.support.runner import answers, sample, sidecar, wait_sample

pytestmark = pytest.mark.nixl

FORMS = releases("KVR_CONFORMANCE_FORGED_VLLM", "0.11.0,0.21.0,0.25.1,0.26.0,0.29.0,0.34.0")
#: Through the processes users run: the scheduler listener's two request forms (every release
#: named, when the variable names them).
SERVED = [v for v in FORMS if v in ("0.21.0", "0.34.0")] or FORMS
API_KEY = "d-api-key"


def reads_pp(version: str) -> bool:
    profile = WireProfile.for_version(spoken(version))
    assert profile is not None
    return profile.wire.pp_on_pull


def forged(version: str, p: PProcess, engine_id: str) -> dict[str, dict[str, Any]]:
    """Changes a client may make to a held request's parameters, by what they forge."""
    changes = {"tp_size": {"tp_size": p.tp + 1, "remote_engine_id": engine_id}}
    if reads_pp(version):
        changes["pp_size"] = {"pp_size": p.pp + 1, "remote_engine_id": engine_id}
    if engine_id != p.engine_id:
        changes["engine_id"] = {"remote_engine_id": engine_id}
    return changes


async def listeners_alive(p: PProcess) -> None:
    """P's listener threads all answer ``is_alive`` (asked after P's step loop settled)."""
    await p.settle()
    before = sum("alive" in e for e in p.events)
    p.send("alive")
    await p.await_(lambda: sum("alive" in e for e in p.events) > before, "liveness answer")
    alive = [e["alive"] for e in p.events if "alive" in e][-1]
    assert alive and all(alive), p.events[-20:]


@pytest.mark.parametrize("version", FORMS)
async def test_forged_parameters_leave_ps_listener_alive_and_a_true_release_frees_every_rank(
    version: str,
) -> None:
    p = PProcess(fetch_wheel(version), 2, 2 if reads_pp(version) else 1)
    try:
        ranks = sorted((pp, tp) for pp in range(p.pp) for tp in range(p.tp))
        true_id, own_id = p_request_id(version, "true"), p_request_id(version, "own")
        await p.hold(true_id)
        await p.hold(own_id)
        first = await releaser(version)
        try:
            for name, changes in forged(version, p, "bogus").items():
                with pytest.raises(EngineMismatch):  # rank (0, 0) alone was asked
                    await first.release(job(version, p, f"forged-{name}", **changes))
                await listeners_alive(p)
            # P's own parameters (router mode's, or vouched for by the router hop) prove its ranks:
            # a client's claim of more, P's true engine id and all, asks P nothing.
            assert await first.release(job(version, p, "own").but(vouched=True)) is JobResult.SENT
            await p.await_(lambda: p.finished(own_id) == ranks, f"{own_id} freed on every rank")
            for name, changes in forged(version, p, p.engine_id).items():
                with pytest.raises(TopologyMismatch):
                    await first.release(job(version, p, f"claimed-{name}", **changes))
            await listeners_alive(p)
        finally:
            await first.close()
        # A sidecar that never saw P (no cache, no evidence) handshakes anew: the listener answers.
        second = await releaser(version)
        try:
            assert await second.release(job(version, p, "true")) is JobResult.SENT
            await p.await_(lambda: p.finished(true_id) == ranks, f"{true_id} freed on every rank")
        finally:
            await second.close()
        await listeners_alive(p)
        assert not p.logs("unrecognized request") and not [e for e in p.events if "error" in e]
        assert not [e for e in p.events if e.get("notif", "").startswith(("forged", "claimed"))]
    finally:
        p.stop()


# --- through the processes users run ---------------------------------------------------------------


@asynccontextmanager
async def p_holding(version: str) -> AsyncIterator[tuple[PProcess, str, ServerThread]]:
    """vLLM's P at TP 1 holding the request ``true``; D (the decode simulator) reporting
    ``version`` and answering 401 to a request without its API key; (P, P's id of ``true``, D)."""
    p = PProcess(fetch_wheel(version), 1, 1)
    try:
        true_id = p_request_id(version, "true")
        await p.hold(true_id)
        config = DecodeSimConfig(port=0, version=version, max_model_len=40, model="m", api_key=API_KEY)
        with serve(create_decode_app(config)) as d:
            yield p, true_id, d
    finally:
        p.stop()


def ask(url: str, version: str, p: PProcess, rid: str, **changes: Any) -> int:
    """A completion carrying the parameters of P's request ``rid`` (with ``changes``), no API key."""
    params = {**p_params(version, p, rid), "do_remote_decode": False, **changes}
    messages = [{"role": "user", "content": "tok tok tok"}]
    body = {"model": "m", "messages": messages, "max_tokens": 2, "kv_transfer_params": params}
    # The chat route: before 0.13.0 P's id is chatcmpl-<x-request-id> (p_request_id).
    response = httpx.post(url + "/v1/chat/completions", json=body, headers={"x-request-id": rid}, timeout=10)
    return response.status_code


@pytest.mark.parametrize("version", SERVED)
async def test_forged_requests_through_serve_with_its_shipped_defaults_leave_p_alive(version: str) -> None:
    """The reported attack: a client without D's key sends a held request's parameters with a
    ``tp_size`` (or ``pp_size``) P lacks and a made-up engine id. D answers 401, the sidecar
    releases: rank (0, 0) alone is asked, and P's listener keeps answering."""
    port, admin = free_port(), free_port()
    url, admin_url = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{admin}"
    async with p_holding(version) as (p, true_id, d):
        args = ["--decode-url", d.url, "--release", "nixl", "--prefill-allow", "127.0.0.1"]
        args += ["--host", "127.0.0.1", "--port", str(port)]
        args += ["--admin-host", "127.0.0.1", "--admin-port", str(admin)]
        with sidecar(args, {}, lambda: answers(admin_url + "/readyz")):
            changes = forged(version, p, "bogus")
            for name, change in changes.items():
                assert ask(url, version, p, f"forged-{name}", **change) == 401
            wait_sample(admin_url, "kvr_nixl_refused_total", len(changes), reason="engine_mismatch")
            await listeners_alive(p)
            assert ask(url, version, p, "true") == 401
            await p.await_(lambda: p.finished(true_id) == [(0, 0)], f"{true_id} freed", within=30)
            wait_sample(admin_url, "kvr_releases_total", 1, strategy="nixl", result="sent")
        await listeners_alive(p)


@pytest.mark.parametrize("version", SERVED)
async def test_a_clients_own_forged_parameters_through_pd_sidecar_never_reach_p(version: str) -> None:
    """``pd-sidecar`` with ``KVR_PREFILL_ALLOW`` naming P and a request without llm-d's header:
    the client's own parameters, P's true engine id with a topology P lacks, go to D (401) and
    are never released. P's listener is never asked, and answers a true release afterwards."""
    port, admin = free_port(), free_port()
    url, admin_url = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{admin}"
    async with p_holding(version) as (p, true_id, d):
        args = [f"--port={port}", f"--model-server-port={d.port}", "--secure-proxy=false"]
        args.append("--kv-connector=nixlv2")
        env = {"KVR_ADMIN_PORT": str(admin), "KVR_PREFILL_ALLOW": "127.0.0.1"}
        with sidecar(args, env, lambda: answers(admin_url + "/readyz")):
            changes = forged(version, p, p.engine_id)
            for name, change in changes.items():
                assert ask(url, version, p, f"forged-{name}", **change) == 401
            assert ask(url, version, p, "true") == 401  # P's true parameters: the client's own
            reason = "client_params_dropped"
            wait_sample(admin_url, "kvr_ineligible_total", len(changes) + 1, reason=reason)
            assert sample(admin_url, "kvr_nixl_handshakes_total", result="ok") == 0
            assert sample(admin_url, "kvr_releases_total", strategy="nixl", result="sent") == 0
        await listeners_alive(p)
        assert p.finished(true_id) == []
        direct = await releaser(version)  # the listener still answers a true release
        try:
            assert await direct.release(job(version, p, "true")) is JobResult.SENT
            await p.await_(lambda: p.finished(true_id) == [(0, 0)], f"{true_id} freed")
        finally:
            await direct.close()
