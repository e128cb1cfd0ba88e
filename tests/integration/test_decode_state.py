"""``DecodeState`` against real decode simulators: real uvicorn servers on ephemeral ports,
the sidecar's own HTTP client (``sidecar.upstream.Upstream``), the simulator's engine modes
switched at run time through ``POST /sim/engine``."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest

from sidecar.decode.probes import probe_kv_connector
from sidecar.decode.state import DecodeState, DecodeView
from sidecar.sim.decode import DecodeSimConfig, create_decode_app
from sidecar.sim.decode.engine import CLIENT_MESSAGE
from sidecar.sim.servers import ServerThread, serve
from sidecar.upstream import Upstream, UpstreamError
from tests.support.runner import run_sidecar
from tests.support.until import until_async

REMOTE = {"do_remote_prefill": True, "remote_request_id": "p-1", "remote_block_ids": [[1]]}
CHAT = {"model": "sim-model", "messages": [{"role": "user", "content": "hi"}], "kv_transfer_params": REMOTE}


@asynccontextmanager
async def upstream_to(url: str) -> AsyncIterator[Upstream]:
    upstream = Upstream(
        url, connect_timeout=1.0, pool_timeout=1.0, header_timeout=5.0, read_timeout=5.0, pool_size=8
    )
    await upstream.start()
    try:
        yield upstream
    finally:
        await upstream.close()


@asynccontextmanager
async def watching(server: ServerThread, **kwargs: Any) -> AsyncIterator[DecodeState]:
    """A started ``DecodeState`` polling ``server`` every 10 ms."""
    async with upstream_to(server.url) as upstream:
        state = DecodeState(upstream, interval=kwargs.pop("interval", 0.01), **kwargs)
        await state.start()
        try:
            yield state
        finally:
            await state.close()


def switch(server: ServerThread, **change: Any) -> None:
    response = httpx.post(server.url + "/sim/engine", json=change, timeout=5.0)
    assert response.status_code == 200, response.text


async def test_a_live_0_33_d_can_notify() -> None:
    with serve(create_decode_app(DecodeSimConfig(version="0.33.0"))) as d:
        async with watching(d) as state:
            assert state.view() == DecodeView("alive", False, True, "0.33.0")
            assert state.view().can_notify


async def test_a_dead_engine_is_seen_by_the_poller_and_by_its_answers() -> None:
    with serve(create_decode_app(DecodeSimConfig(version="0.33.0"))) as d:
        async with watching(d) as state:
            switch(d, engine="dead")
            await until_async(lambda: state.view().engine == "dead")
            assert not state.view().can_notify
            switch(d, engine="alive")
            await until_async(lambda: state.view().can_notify)
        # The passive path: D's own answer to a completion request marks the engine dead at once.
        switch(d, engine="dead")
        async with upstream_to(d.url) as upstream:
            state = DecodeState(upstream, interval=3600.0)
            headers = [("content-type", "application/json")]
            async with await upstream.send(
                "POST", "/v1/chat/completions", headers, json.dumps(CHAT).encode()
            ) as answer:
                error = json.loads(await answer.read(4096))["error"]
            assert (answer.status, error["message"]) == (500, CLIENT_MESSAGE)
            state.observe(answer.status, error["message"])
            assert state.view().engine == "dead"


async def test_a_shutting_down_0_33_d_shows_nothing_until_the_sidecar_drains() -> None:
    # vLLM 0.28.0+ keeps serving HTTP, /health 200, while its engine core drops every request.
    with serve(create_decode_app(DecodeSimConfig(version="0.33.0", engine="shutting_down"))) as d:
        async with watching(d) as state:
            assert state.view() == DecodeView("alive", False, True, "0.33.0")
            state.draining()
            assert state.view().shutting_down and not state.view().can_notify


async def test_a_shutting_down_0_25_d_says_connection_close() -> None:
    # Up to 0.27.x uvicorn's own SIGTERM handler runs too: answers carry Connection: close.
    with serve(create_decode_app(DecodeSimConfig(version="0.25.1", engine="shutting_down"))) as d:
        async with watching(d) as state:
            assert state.view().shutting_down and not state.view().can_notify
            switch(d, engine="alive")  # D restarted
            await until_async(lambda: state.view().can_notify)


async def test_a_stopped_d_is_unknown_and_its_return_is_seen() -> None:
    d = ServerThread(create_decode_app(DecodeSimConfig())).start()
    async with watching(d) as state:
        assert state.view().can_notify
        d.stop()  # nothing listens on the port any more
        await until_async(lambda: state.view().engine == "unknown")
        assert not state.view().can_notify


async def test_a_d_without_kv_connector_cannot_notify_and_is_warned_about(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with serve(create_decode_app(DecodeSimConfig(kv_connector=False))) as d:
        with caplog.at_level(logging.WARNING, logger="sidecar.decode_state"):
            async with watching(d) as state:
                assert state.view() == DecodeView("alive", False, False, "0.34.0")
                assert not state.view().can_notify
        async with upstream_to(d.url) as upstream:
            assert await probe_kv_connector(upstream) is False
    assert any("no NIXL KV connector" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(("setting", "kv"), [("auto", None), ("yes", True), ("no", False)])
async def test_a_d_without_stats_cannot_tell_unless_configured(setting: str, kv: bool | None) -> None:
    with serve(create_decode_app(DecodeSimConfig(log_stats=False))) as d:
        async with watching(d, kv_connector=setting) as state:
            assert state.view().kv_connector is kv
            assert state.view().can_notify is (kv is not False)
        async with upstream_to(d.url) as upstream:
            assert await probe_kv_connector(upstream) is None


async def test_the_kv_connector_is_read_again_when_d_comes_back() -> None:
    with serve(create_decode_app(DecodeSimConfig())) as d:
        async with watching(d) as state:
            assert state.view().kv_connector is True
            switch(d, engine="dead")
            await until_async(lambda: state.view().engine == "dead")
            switch(d, engine="alive", kv_connector=False)  # a new D, started without a connector
            await until_async(lambda: state.view().engine == "alive")
            assert state.view().kv_connector is False


async def test_an_unreachable_d_leaves_kv_connector_unknown() -> None:
    async with upstream_to("http://127.0.0.1:9") as upstream:  # discard port: nothing listens
        with pytest.raises(UpstreamError):
            await upstream.send("GET", "/health", [], None)
        assert await probe_kv_connector(upstream) is None
        state = DecodeState(upstream, interval=3600.0)
        await state.start()
        await state.close()
    assert state.view() == DecodeView("unknown", False, None, None)


def test_a_d_whose_version_is_no_version_is_warned_at_start_and_shown_as_a_metric(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The sidecar as it ships (nixl, no vllm_version) in front of a D whose ``GET /version`` names
    no version: it says so as it starts, and the metric stays 1 while releases are refused."""
    caplog.set_level(logging.WARNING, logger="sidecar.version")
    with (
        serve(create_decode_app(DecodeSimConfig(version="garbage"))) as d,
        run_sidecar(d.url, release="nixl", prefill_allow=("127.0.0.1",)) as sc,
    ):
        assert sc.sample("kvr_vllm_version_unusable", reason="not_a_version") == 1
        [line] = [r.getMessage() for r in caplog.records if "GET /version" in r.getMessage()]
        assert line.startswith("D's GET /version named 'garbage', not a version: P's vLLM release is unknown")
        params = {**REMOTE, "remote_engine_id": "e", "remote_host": "127.0.0.1", "remote_port": 5600}
        body = {**CHAT, "max_tokens": "x", "kv_transfer_params": params}
        assert httpx.post(sc.url + "/v1/chat/completions", json=body, timeout=10).status_code == 400
        sc.settle()
        assert sc.sample("kvr_nixl_refused_total", reason="unknown_version") == 1
