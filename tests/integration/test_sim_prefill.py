"""The prefill simulator against real NIXL agents, real ZMQ and real uvicorn.

Three releases with different wire formats: 0.33.0 (TP 2 x PP 2, scheduler
listener, [msg, pp, tp], two reply frames, generation), 0.21.0 (TP 2, [msg,
tp], one frame, payload envelope) and 0.11.0 (TP 2, per-worker listeners, raw
requests, bare metadata, no remote_request_id). D's side is
``sidecar.sim.dclient``, written separately from the simulator. Every wait
polls with a deadline.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import msgspec
import pytest
import zmq

from sidecar.sim.dclient import DecodeClient, HandshakeError
from sidecar.sim.prefill import PrefillSimConfig, create_prefill_app
from sidecar.sim.servers import serve

pytestmark = pytest.mark.nixl

# (version, tp, pp)
RELEASES = [("0.33.0", 2, 2), ("0.21.0", 2, 1), ("0.11.0", 2, 1)]
IDS = [version for version, _, _ in RELEASES]


def words(n: int) -> str:
    return " ".join(["tok"] * n)


@pytest.fixture(params=RELEASES, ids=IDS)
def release(request: pytest.FixtureRequest) -> tuple[str, int, int]:
    value: tuple[str, int, int] = request.param
    return value


class Sim:
    """A running simulator, an HTTP client to it and a D client of the same release."""

    def __init__(self, url: str, http: httpx.AsyncClient, dclient: DecodeClient, version: str) -> None:
        self.url, self.http, self.dclient, self.version = url, http, dclient, version

    async def stats(self) -> dict[str, Any]:
        response = await self.http.get("/stats")
        assert response.status_code == 200
        data: dict[str, Any] = response.json()
        return data

    async def wait_stats(
        self, check: Callable[[dict[str, Any]], bool], within: float = 10.0
    ) -> dict[str, Any]:
        deadline = time.monotonic() + within
        while True:
            stats = await self.stats()
            if check(stats):
                return stats
            assert time.monotonic() < deadline, f"stats never matched: {stats}"
            await asyncio.sleep(0.01)

    async def prefill(self, n_tokens: int, xrid: str, route: str = "/v1/completions") -> httpx.Response:
        body: dict[str, Any] = {"model": "m", "max_tokens": 1}
        if route == "/v1/completions":
            body["prompt"] = words(n_tokens)
        else:
            body["messages"] = [{"role": "user", "content": words(n_tokens)}]
        body["kv_transfer_params"] = {"do_remote_decode": True, "do_remote_prefill": False}
        return await self.http.post(route, json=body, headers={"x-request-id": xrid})

    async def pin(self, n_tokens: int, xrid: str) -> tuple[dict[str, Any], str]:
        """Prefill one request; returns its kv_transfer_params and P's internal id."""
        response = await self.prefill(n_tokens, xrid)
        assert response.status_code == 200, response.text
        params: dict[str, Any] = response.json()["kv_transfer_params"]
        internal = params.get("remote_request_id") or f"cmpl-{xrid}-0"  # <0.13.0: D's own id
        described = await self.http.get(f"/sim/requests/{internal}")
        assert described.status_code == 200 and described.json()["pinned"] is True
        return params, internal


@asynccontextmanager
async def running(
    release: tuple[str, int, int], d_timeout: float = 2.0, **overrides: Any
) -> AsyncIterator[Sim]:
    version, tp, pp = release
    settings: dict[str, Any] = {"num_blocks": 64, "lease": 30.0, "side_channel_port": 0}
    settings.update(overrides)
    config = PrefillSimConfig(vllm_version=version, tp=tp, pp=pp, **settings)
    with serve(create_prefill_app(config)) as server:
        async with (
            httpx.AsyncClient(base_url=server.url, timeout=10) as http,
            DecodeClient(version, timeout=d_timeout) as dclient,
        ):
            yield Sim(server.url, http, dclient, version)


@pytest.fixture
def zmq_ctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


async def test_release_frees_on_every_rank(release: tuple[str, int, int]) -> None:
    _, tp, pp = release
    ranks = tp * pp
    async with running(release) as sim:
        params, internal = await sim.pin(40, "rel-1")  # 40 tokens / 16 = 3 blocks
        before = await sim.stats()
        assert before["blocks_in_use"] == 3 and before["pinned_requests"] == 1
        message = await sim.dclient.release(params, request_id=internal)
        assert message == f"{internal}:1".encode()
        after = await sim.wait_stats(lambda s: s["freed_by_notification"] == 1)
        assert after["blocks_in_use"] == 0 and after["pinned_requests"] == 0
        assert after["rank_finished_by_notification"] == [1] * ranks
        assert after["notifs_per_rank"] == [1] * ranks
        assert after["freed_by_expiry"] == 0 and after["notifs_unknown"] == 0
        assert after["handshakes_served"] == ranks
        state = (await sim.http.get(f"/sim/requests/{internal}")).json()
        assert state["pinned"] is False and state["freed_by"] == "notification"
        assert state["ranks_notified"] == list(range(ranks))
        (freed,) = (await sim.http.post("/sim/freed")).json()["freed"]
        assert freed[0] == internal and freed[2] == "notification" and freed[1] <= time.monotonic()


async def test_unnotified_request_expires_then_late_release_is_unknown(release: tuple[str, int, int]) -> None:
    _, tp, pp = release
    async with running(release, lease=1.0) as sim:
        params, internal = await sim.pin(10, "exp-1")
        stats = await sim.wait_stats(lambda s: s["freed_by_expiry"] == 1)
        assert stats["blocks_in_use"] == 0 and stats["freed_by_notification"] == 0
        assert stats["rank_finished_by_expiry"] == [1] * (tp * pp)
        assert stats["pinned_block_seconds"] >= 0.9  # one block held for about the lease
        metrics = (await sim.http.get("/metrics")).text
        assert 'vllm:nixl_num_kv_expired_reqs_total{engine="0",model_name="sim-model"} 1.0' in metrics
        assert 'vllm:kv_cache_usage_perc{engine="0",model_name="sim-model"} 0.0' in metrics
        await sim.dclient.release(params, request_id=internal)
        late = await sim.wait_stats(lambda s: s["notifs_unknown"] == tp * pp)
        assert late["freed_by_notification"] == 0 and late["worker_errors"] == 0


async def test_unknown_id_is_counted_and_harmless(release: tuple[str, int, int]) -> None:
    _, tp, pp = release
    async with running(release) as sim:
        params, internal = await sim.pin(20, "unk-1")
        sent = await sim.dclient.notify(params, b"not-a-request-of-p:1")
        assert sent == tp * pp
        stats = await sim.wait_stats(lambda s: s["notifs_unknown"] == tp * pp)
        assert stats["pinned_requests"] == 1 and stats["blocks_in_use"] == 2
        await sim.dclient.notify(params, b"no-colon-here")  # raises in a real P's worker
        stats = await sim.wait_stats(lambda s: s["notifs_malformed"] == tp * pp)
        assert stats["worker_errors"] == tp * pp and stats["pinned_requests"] == 1
        await sim.dclient.release(params, request_id=internal)  # the worker keeps going
        await sim.wait_stats(lambda s: s["freed_by_notification"] == 1)


async def test_out_of_blocks_is_a_vllm_shaped_503(release: tuple[str, int, int]) -> None:
    async with running(release, num_blocks=4) as sim:
        refused = await sim.prefill(100, "big-1")  # needs 7 blocks
        assert refused.status_code == 503
        error = refused.json()["error"]
        assert error["code"] == 503 and set(error) == {"message", "type", "param", "code"}
        fits = await sim.prefill(64, "fits-1")  # exactly 4 blocks
        assert fits.status_code == 200
        again = await sim.prefill(1, "one-more")
        assert again.status_code == 503
        stats = await sim.stats()
        assert stats["refused_no_blocks"] == 2 and stats["blocks_in_use"] == 4


async def test_response_shapes(release: tuple[str, int, int]) -> None:
    version, tp, pp = release
    async with running(release) as sim:
        chat = await sim.prefill(17, "chat-1", route="/v1/chat/completions")
        body = chat.json()
        assert body["id"] == "chatcmpl-chat-1" and body["object"] == "chat.completion"
        params = body["kv_transfer_params"]
        assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
        assert params["tp_size"] == tp and params["remote_port"] == (await sim.stats())["side_channel_port"]
        if version == "0.33.0":
            assert params["remote_block_ids"] == [[1, 2]] and params["pp_size"] == pp
            assert params["remote_request_id"].startswith("chatcmpl-chat-1-")
            assert len(params["remote_request_id"].rsplit("-", 1)[1]) == 8
            assert params["remote_registration_generation"] == 0 and params["transfer_mode"] == "pull"
        elif version == "0.21.0":
            assert params["remote_block_ids"] == [[1, 2]] and params["remote_num_tokens"] == 17
            assert "pp_size" not in params and "transfer_mode" not in params
        else:
            assert params["remote_block_ids"] == [1, 2] and "remote_request_id" not in params
        empty = await sim.prefill(0, "empty-1")
        assert empty.json()["kv_transfer_params"]["remote_block_ids"] in ([], [[]])
        plain = await sim.http.post("/v1/completions", json={"model": "m", "prompt": words(30)})
        assert plain.status_code == 200 and plain.json()["kv_transfer_params"] is None
        stats = await sim.stats()
        assert stats["pinned_requests"] == 1 and stats["blocks_in_use"] == 2
        assert (await sim.http.get("/version")).json() == {"version": version}
        metrics = (await sim.http.get("/metrics")).text
        assert "kvr_sim_prefill_blocks_in_use 2.0" in metrics
        # vLLM's names for what a P is checked by: 2 of 64 blocks pinned, none expired yet.
        labels = '{engine="0",model_name="sim-model"}'
        assert f"vllm:kv_cache_usage_perc{labels} 0.03125" in metrics
        assert f"vllm:nixl_num_kv_expired_reqs_total{labels} 0.0" in metrics


def _send_bad_handshake(ctx: zmq.Context[zmq.Socket[bytes]], version: str, port: int) -> None:
    if version == "0.11.0":
        # A DEALER without the empty delimiter frame: the ROUTER unpacks 2 frames, not 3.
        sock = ctx.socket(zmq.DEALER)
        sock.connect(f"tcp://127.0.0.1:{port}")
        sock.send(b"get_meta_msg")
    else:
        sock = ctx.socket(zmq.REQ)
        sock.connect(f"tcp://127.0.0.1:{port}")
        bad = [b"get_meta_msg", 0] if version == "0.33.0" else [b"get_meta_msg", 7]
        sock.send(msgspec.msgpack.encode(bad))  # wrong length / a rank P does not have
    sock.close(linger=2000)  # the context's term() waits (bounded) until it is delivered


async def test_malformed_handshake_kills_the_listener(
    release: tuple[str, int, int], zmq_ctx: zmq.Context[zmq.Socket[bytes]]
) -> None:
    version, _, _ = release
    async with running(release, d_timeout=0.3) as sim:
        params, _ = await sim.pin(5, "hs-1")
        assert (await sim.stats())["listener_alive"] is True
        await asyncio.to_thread(_send_bad_handshake, zmq_ctx, version, params["remote_port"])
        dead = await sim.wait_stats(lambda s: s["listener_alive"] is False)
        assert dead["listener_dead"] is True and any(dead["listener_errors"])
        with pytest.raises(HandshakeError):
            await sim.dclient.handshake(params)
        health = await sim.http.get("/health")
        assert health.status_code == 200  # like vLLM, /health ignores the side channel


async def test_raw_request_is_answered_by_a_per_worker_listener(
    zmq_ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    async with running(("0.11.0", 2, 1)) as sim:
        stats = await sim.stats()

        def ask(port: int) -> list[bytes]:
            sock = zmq_ctx.socket(zmq.REQ)
            sock.setsockopt(zmq.RCVTIMEO, 2000)
            sock.connect(f"tcp://127.0.0.1:{port}")
            sock.send(b"anything at all")  # <=0.11.0 answers any single-frame request
            try:
                return sock.recv_multipart()
            finally:
                sock.close(linger=0)

        frames = await asyncio.to_thread(ask, stats["side_channel_port"] + 1)
        assert len(frames) == 1
        meta = msgspec.msgpack.decode(frames[0])
        assert meta["engine_id"] == stats["engine_id"] and "remote_request_id" not in meta
        assert list(meta) == [
            "engine_id", "agent_metadata", "kv_caches_base_addr", "num_blocks",
            "block_lens", "attn_backend_name", "kv_cache_layout",
        ]  # fmt: skip
        assert (await sim.stats())["listener_alive"] is True


async def test_restart_agents_changes_names_and_d_rehandshakes(release: tuple[str, int, int]) -> None:
    version, tp, pp = release
    async with running(release) as sim:
        params, internal = await sim.pin(5, "rs-1")
        old_names = set((await sim.dclient.handshake(params)).values())
        assert old_names == set((await sim.stats())["agent_names"])
        restarted = (await sim.http.post("/sim/restart-agents")).json()
        assert len(restarted["agent_names"]) == tp * pp
        assert not old_names & set(restarted["agent_names"])
        assert restarted["registration_generation"] == 1
        params2, internal2 = await sim.pin(5, "rs-2")
        # 0.33.0 carries the generation, so D re-handshakes by itself; older D must be told.
        gen_aware = version == "0.33.0"
        if gen_aware:
            assert params2["remote_registration_generation"] == 1
        new_names = set((await sim.dclient.handshake(params2, force=not gen_aware)).values())
        assert new_names == set(restarted["agent_names"])
        await sim.dclient.release(params2, request_id=internal2)
        await sim.dclient.release(params, request_id=internal)  # pinned before the restart
        stats = await sim.wait_stats(lambda s: s["freed_by_notification"] == 2)
        assert stats["blocks_in_use"] == 0


async def test_reset_clears_counters_and_unknown_ids_404(release: tuple[str, int, int]) -> None:
    async with running(release) as sim:
        await sim.pin(5, "rst-1")
        assert (await sim.stats())["requests_pinned"] == 1
        reset = (await sim.http.post("/sim/reset")).json()
        assert reset["requests_pinned"] == 0 and reset["pinned_requests"] == 1
        missing = await sim.http.get("/sim/requests/never-seen")
        assert missing.status_code == 404
