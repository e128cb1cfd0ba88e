"""TODO docstring."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import msgspec
from prometheus_client import CollectorRegistry

from sidecar.config import Config
from sidecar.decision.judge import InFlight
from sidecar.observability.metrics import Metrics
from sidecar.proxy import Proxy, ProxyParts
from sidecar.proxy.handler import Injector
from sidecar.proxy.trust import Trust
from sidecar.release.base import JobResult, ReleaseJob
from sidecar.release.dryrun import DryRun
from sidecar.release.ledger import Ledger
from sidecar.release.pipeline import Pipeline, Retry, Settings
from sidecar.router import PrefillPool
from sidecar.router.legs import Router
from tests.support.fakes import Client, FakeDecode, FakeRequest, FakeResponse, FakeUpstream

V033 = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_engine_id": "p-engine",
    "remote_request_id": "cmpl-r1-0-abcd1234",
    "remote_host": "10.0.0.7",
    "remote_port": 5600,
    "remote_block_ids": [[1, 2, 3]],
    "tp_size": 1,
    "remote_num_tokens": 40,
    "transfer_mode": "pull",
    "pp_size": 1,
    "dcp_size": 1,
    "remote_registration_generation": 0,
}


class Recorder:
    """A strategy that frees (so the proxy's release semantics apply) and records each job."""

    name = "fake"
    frees = True
    checked = True
    keeps_raw = False

    def __init__(self) -> None:
        self.jobs: list[ReleaseJob] = []

    async def start(self) -> None: ...
    async def close(self) -> None: ...

    def ready(self) -> bool:
        return True

    def detail(self) -> dict[str, object]:
        return {}

    def target(self, job: ReleaseJob) -> str:
        return "p"

    async def release(self, job: ReleaseJob) -> JobResult:
        self.jobs.append(job)
        return JobResult.SENT

    async def rehearse(self, job: ReleaseJob) -> JobResult:
        self.jobs.append(job)
        return JobResult.WOULD_SEND


class Rig:
    """A proxy, its fakes and its metrics."""

    def __init__(self, proxy: Proxy, d: FakeUpstream, releaser: Recorder, metrics: Metrics) -> None:
        self.proxy, self.d, self.releaser, self.metrics = proxy, d, releaser, metrics

    async def call(self, client: Client) -> Client:
        await self.proxy(client.scope(), client.receive, client.send)
        await self.proxy.pipeline.flush(2)
        return client

    def result(self, result: str) -> float:
        labels = {"strategy": "fake", "result": result}
        return self.metrics.registry.get_sample_value("kvr_releases_total", labels) or 0.0


def started_pipeline(releaser: Recorder, metrics: Metrics, queue_size: int, workers: int) -> Pipeline:
    settings = Settings(queue_size=queue_size, workers=workers, retry=Retry(0.01, 0.05))
    pipeline = Pipeline(releaser, metrics, Ledger(100, 60), settings)
    pipeline.start()
    return pipeline


def proxy_parts(
    config: Config, d: FakeUpstream, pipeline: Pipeline, metrics: Metrics, **more: Any
) -> ProxyParts:
    """The proxy's parts around the fake upstream ``d``; ``more``: decode, pool."""
    return ProxyParts(
        upstream=d,  # type: ignore[arg-type]
        pipeline=pipeline,
        metrics=metrics,
        trust=Trust(config),
        inflight=InFlight(100, 30),
        injector=Injector(config),
        **more,
    )


@asynccontextmanager
async def rig(d: FakeUpstream, decode: FakeDecode | None = None, **settings: Any) -> AsyncIterator[Rig]:
    config = Config(**{"release": "nixl", "may_cover_delay": 0.05, **settings})
    metrics, releaser = Metrics(CollectorRegistry()), Recorder()
    strategy = DryRun(releaser) if config.dry_run else releaser
    pipeline = started_pipeline(strategy, metrics, queue_size=100, workers=4)
    parts = proxy_parts(config, d, pipeline, metrics, decode=decode or FakeDecode())
    try:
        yield Rig(Proxy(config, parts), d, releaser, metrics)
    finally:
        await pipeline.stop()


def completion(params: dict[str, Any] | None = None, **fields: Any) -> bytes:
    body: dict[str, Any] = {"model": "m", "prompt": "hi", "max_tokens": 4, **fields}
    if params is not None:
        body["kv_transfer_params"] = params
    return msgspec.json.encode(body)


def error(status: int, type_: str) -> FakeResponse:
    return FakeResponse.json(
        status, {"error": {"message": "no", "type": type_, "param": None, "code": status}}
    )


P1, P2 = "http://p1.test:8100", "http://p2.test:8100"


def prefilled(request: FakeRequest) -> FakeResponse:
    """P pins the prompt and answers its parameters (and its cached tokens)."""
    usage = {"prompt_tokens": 9, "prompt_tokens_details": {"cached_tokens": 4}}
    return FakeResponse.json(200, {"choices": [], "usage": usage, "kv_transfer_params": V033})


class LegsRig:
    def __init__(
        self, proxy: Proxy, d: FakeUpstream, ps: dict[str, FakeUpstream], releaser: Recorder
    ) -> None:
        self.proxy, self.d, self.ps, self.releaser = proxy, d, ps, releaser

    async def call(self, client: Client) -> Client:
        await self.proxy(client.scope(), client.receive, client.send)
        await self.proxy.pipeline.flush(2)
        return client


@asynccontextmanager
async def router(
    d: FakeUpstream, p1: Any = prefilled, p2: Any = prefilled, **settings: Any
) -> AsyncIterator[LegsRig]:
    config = Config(**{"release": "nixl", "prefill": (P1, P2), "prefill_policy": "round-robin", **settings})
    ps = {P1: FakeUpstream(p1, P1), P2: FakeUpstream(p2, P2)}
    metrics, releaser = Metrics(CollectorRegistry()), Recorder()
    pipeline = started_pipeline(releaser, metrics, queue_size=10, workers=2)
    pool = PrefillPool(config, connect=lambda url: ps[url])  # type: ignore[arg-type,return-value]
    parts = proxy_parts(
        config,
        d,
        pipeline,
        metrics,
        decode=FakeDecode(),
        routing=lambda proxy: Router(proxy, pool, config, metrics, Trust(config).outgoing),
    )
    try:
        yield LegsRig(Proxy(config, parts), d, ps, releaser)
    finally:
        await pipeline.stop()
