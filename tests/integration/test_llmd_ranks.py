"""Each data-parallel rank's D is probed on its own port: /readyz and the release decision follow it.

Two sim-decode servers on consecutive ports are D's ranks 0 and 1; the sidecar
runs in process with two serving listeners (``RankFront`` for each rank, as
``serve`` runs them) and a recording releaser that frees (so D's state is
polled, as with ``--release nixl``). A rank whose D cannot release P's blocks
itself has its rejections released by the sidecar while rank 0's are left to
D; a rank whose engine dies makes ``/readyz`` say so, by name.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
from prometheus_client import CollectorRegistry

from sidecar.app import Deps, ProxyApp, create_admin_app, create_app
from sidecar.app.ranks import RankFront
from sidecar.config import Config
from sidecar.sim.decode.config import DecodeSimConfig
from sidecar.sim.servers import ServerThread
from tests.support.ports import free_port
from tests.support.ranked import ranked
from tests.support.runner import Recording, kv_params
from tests.support.until import until

MODEL = "m"


@contextmanager
def two_ranks(d_base: int) -> Iterator[tuple[list[str], str, ProxyApp, Recording]]:
    """The sidecar with ranks 0 and 1 in front of D's ranks on ``d_base``; yields the serving URLs,
    the admin URL, the app and the releaser."""
    base = free_port(2)
    config = Config(
        decode_url=f"http://127.0.0.1:{d_base}",
        port=base,
        data_parallel_size=2,
        release="nixl",
        decode_health_interval=0.05,
        log_level="warning",
    )
    releaser = Recording(keep=100, frees=True, keeps_raw=False)
    app = create_app(config, Deps(releaser=releaser, registry=CollectorRegistry()))
    server = ServerThread(RankFront(app, 0, config), RankFront(app, 1, config), create_admin_app(app))
    try:
        yield server.start().urls[:2], server.urls[2], app, releaser
    finally:
        server.stop()


def rejected_by_d_s_handler(url: str, rid: str) -> None:
    """A request D's handler refuses (an unknown model): D's own fix covers it while D can notify."""
    body: dict[str, Any] = {"model": "no-such-model", "prompt": "hi", "kv_transfer_params": kv_params(rid)}
    assert httpx.post(url + "/v1/completions", json=body, headers={"x-request-id": rid}).status_code == 404


def test_each_rank_s_judge_reads_its_own_d() -> None:
    d_base = free_port(2)
    configs = [DecodeSimConfig(port=0, model=MODEL), DecodeSimConfig(port=0, model=MODEL, kv_connector=False)]
    with ranked(configs, d_base), two_ranks(d_base) as (urls, _, app, releaser):
        assert app.runtime is not None and app.runtime.decode is not None
        assert app.runtime.decode.view().can_notify  # rank 0's D: a KV connector, alive
        rank1 = app.runtime.ranks[0].state
        assert rank1 is not None and not rank1.view().can_notify  # rank 1's D: no KV connector
        rejected_by_d_s_handler(urls[0], "on-rank-0")
        rejected_by_d_s_handler(urls[1], "on-rank-1")
        until(lambda: len(releaser.recorded) >= 1, "the sidecar released rank 1's rejection")
        app_settled(app)
        assert [job.params.remote_request_id for job in releaser.recorded] == ["on-rank-1"]


def test_readyz_names_each_rank_s_d_and_is_not_ready_without_one() -> None:
    d_base = free_port(2)
    configs = [DecodeSimConfig(port=0, model=MODEL)] * 2
    with ranked(configs, d_base) as ds, two_ranks(d_base) as (_, admin, _app, _):
        ready = httpx.get(admin + "/readyz")
        assert ready.status_code == 200
        assert ready.json()["checks"] | {"decode": True, "decode_rank_1": True} == ready.json()["checks"]
        assert httpx.post(ds[1].url + "/sim/engine", json={"engine": "dead"}).status_code == 200
        until(lambda: httpx.get(admin + "/readyz").status_code == 503, "/readyz saw rank 1's D die")
        checks = httpx.get(admin + "/readyz").json()["checks"]
        assert (checks["decode"], checks["decode_rank_1"]) == (True, False)
        assert httpx.post(ds[1].url + "/sim/engine", json={"engine": "alive"}).status_code == 200
        until(lambda: httpx.get(admin + "/readyz").status_code == 200, "/readyz saw rank 1's D back")


def app_settled(app: ProxyApp) -> None:
    """Every rejection judged: nothing in flight on either rank."""
    assert app.runtime is not None
    until(lambda: not app.runtime.metrics.registry.get_sample_value("kvr_inflight_requests"), "idle")
