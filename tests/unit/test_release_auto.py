"""``AutoReleaser``'s choices with scripted sub-strategies: probes, per-job routing, pinning, metrics."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest
from prometheus_client import CollectorRegistry

from sidecar.config import Config
from sidecar.release.auto import AutoReleaser
from sidecar.release.base import JobResult, PermanentReleaseError, ReleaseJob
from sidecar.release.http import ControlFailed, ControlUnreachable, Probe
from tests.support.fakes import release_params


class FakeControl:
    """Stands in for ``HttpReleaser``: scripted probe answers and release outcomes."""

    name = "http"

    def __init__(self) -> None:
        self.probe_answer: Probe = "present"
        self.outcomes: list[JobResult | Exception] = []
        self.jobs: list[ReleaseJob] = []
        self.probes = 0
        self.started = self.closed = False

    async def start(self) -> None:
        self.started = True

    async def close(self) -> None:
        self.closed = True

    def ready(self) -> bool:
        return self.started and not self.closed

    async def probe(self) -> Probe:
        self.probes += 1
        return self.probe_answer

    def target(self, job: ReleaseJob) -> str:
        return f"{self.name}:{job.params.remote_host}"

    async def release(self, job: ReleaseJob) -> JobResult:
        self.jobs.append(job)
        outcome = self.outcomes.pop(0) if self.outcomes else JobResult.SENT
        if isinstance(outcome, Exception):
            raise outcome
        return outcome


class FakeNixl:
    name = "nixl"

    def __init__(self, *, broken: bool = False) -> None:
        self.broken = broken
        self.jobs: list[ReleaseJob] = []
        self.started = False

    async def start(self) -> None:
        if self.broken:
            raise RuntimeError("NIXL is not installed")
        self.started = True

    async def close(self) -> None:
        self.started = False

    def ready(self) -> bool:
        return self.started

    def target(self, job: ReleaseJob) -> str:
        return f"{self.name}:{job.params.remote_host}"

    async def release(self, job: ReleaseJob) -> JobResult:
        self.jobs.append(job)
        return JobResult.SENT


def job(rid: str = "r1", cause: str = "rejected_4xx") -> ReleaseJob:
    now = time.monotonic()
    params = release_params(
        {
            "do_remote_prefill": True,
            "remote_engine_id": "p",
            "remote_request_id": rid,
            "remote_host": "10.0.0.7",
            "remote_port": 5600,
            "remote_block_ids": [1],
        }
    )
    return ReleaseJob(
        request_id=rid,
        route="/v1/completions",
        params=params,
        cause=cause,
        detected_at=now,
        deadline=now + 30,
        decode_reachable=cause != "unreachable",  # the judge's word on it
    )


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


@pytest.fixture
async def parts(registry: CollectorRegistry) -> AsyncIterator[tuple[AutoReleaser, FakeControl, FakeNixl]]:
    control, nixl = FakeControl(), FakeNixl()
    auto = AutoReleaser(
        Config(release="auto", auto_probe_interval=3600), _no_version, registry, control=control, nixl=nixl
    )
    await auto.start()
    yield auto, control, nixl
    await auto.close()


async def _no_version() -> str | None:
    return None


def path_of(auto: AutoReleaser) -> str:
    return auto.path


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float:
    return registry.get_sample_value(name, labels) or 0.0


async def test_present_endpoint_selects_control(
    parts: tuple[AutoReleaser, FakeControl, FakeNixl], registry: CollectorRegistry
) -> None:
    auto, control, nixl = parts
    assert path_of(auto) == "control" and auto.ready()
    assert await auto.release(job()) is JobResult.SENT
    assert len(control.jobs) == 1 and nixl.jobs == []
    assert sample(registry, "kvr_release_path", path="control") == 1
    assert sample(registry, "kvr_release_path", path="nixl") == 0
    assert sample(registry, "kvr_auto_releases_total", path="control", result="sent") == 1
    assert auto.detail() == {
        "strategy": "auto",
        "path": "control",
        "probe": "present",
        "control_ready": True,
        "nixl_ready": True,
    }


async def test_unreachable_d_goes_to_nixl_even_with_control(
    parts: tuple[AutoReleaser, FakeControl, FakeNixl],
) -> None:
    auto, control, nixl = parts
    assert await auto.release(job(cause="unreachable")) is JobResult.SENT
    assert control.jobs == [] and len(nixl.jobs) == 1


@pytest.mark.parametrize(
    ("answer", "path"),
    [
        ("present", "control"),
        ("absent", "nixl"),
        ("unauthorized", "nixl"),
        ("forbidden", "nixl"),
        ("no_engine", "nixl"),
        ("error", "nixl"),
    ],
)
async def test_probe_chooses_the_path(
    parts: tuple[AutoReleaser, FakeControl, FakeNixl], registry: CollectorRegistry, answer: Probe, path: str
) -> None:
    auto, control, _ = parts
    control.probe_answer = answer
    await auto.probe()
    assert path_of(auto) == path and auto.probed == answer
    assert sample(registry, "kvr_release_path", path=path) == 1


async def test_unreachable_probe_keeps_the_choice(parts: tuple[AutoReleaser, FakeControl, FakeNixl]) -> None:
    auto, control, _ = parts
    control.probe_answer = "unreachable"
    await auto.probe()
    assert path_of(auto) == "control"
    control.probe_answer = "absent"
    await auto.probe()
    control.probe_answer = "unreachable"
    await auto.probe()
    assert path_of(auto) == "nixl"


async def test_undelivered_attempt_falls_back_to_nixl_for_that_job(
    parts: tuple[AutoReleaser, FakeControl, FakeNixl], registry: CollectorRegistry
) -> None:
    auto, control, nixl = parts
    control.outcomes = [ControlUnreachable("refused")]
    assert await auto.release(job()) is JobResult.SENT
    assert len(control.jobs) == 1 and len(nixl.jobs) == 1
    assert path_of(auto) == "control"  # D may be restarting: the next probe decides
    assert sample(registry, "kvr_auto_releases_total", path="nixl", result="sent") == 1


@pytest.mark.parametrize("reason", ["not_found", "unauthorized", "forbidden"])
async def test_route_gone_switches_to_nixl(
    parts: tuple[AutoReleaser, FakeControl, FakeNixl], reason: str
) -> None:
    auto, control, nixl = parts
    control.outcomes = [PermanentReleaseError("gone", reason)]
    assert await auto.release(job()) is JobResult.SENT
    assert len(nixl.jobs) == 1 and path_of(auto) == "nixl"
    await auto.release(job("r2"))
    assert len(control.jobs) == 1 and len(nixl.jobs) == 2


async def test_bad_request_is_refused_not_rerouted(parts: tuple[AutoReleaser, FakeControl, FakeNixl]) -> None:
    auto, control, nixl = parts
    control.outcomes = [PermanentReleaseError("bad", "bad_request")]
    with pytest.raises(PermanentReleaseError):
        await auto.release(job())
    assert nixl.jobs == [] and path_of(auto) == "control"


async def test_maybe_delivered_job_is_pinned_to_control(
    parts: tuple[AutoReleaser, FakeControl, FakeNixl],
) -> None:
    auto, control, nixl = parts
    the_job = job()
    control.outcomes = [
        ControlFailed("timed out", "timeout"),
        ControlUnreachable("D went away"),
        JobResult.SENT,
    ]
    with pytest.raises(ControlFailed):
        await auto.release(the_job)
    control.probe_answer = "absent"
    await auto.probe()
    assert path_of(auto) == "nixl"
    with pytest.raises(ControlUnreachable):  # no switch to NIXL: D's engine may have acted
        await auto.release(the_job)
    assert await auto.release(the_job) is JobResult.SENT
    assert len(control.jobs) == 3 and nixl.jobs == []
    await auto.release(the_job)  # unpinned after success: the path applies again
    assert len(nixl.jobs) == 1


async def test_nixl_failure_at_start_leaves_control(registry: CollectorRegistry) -> None:
    control, nixl = FakeControl(), FakeNixl(broken=True)
    auto = AutoReleaser(Config(release="auto"), _no_version, registry, control=control, nixl=nixl)
    await auto.start()
    try:
        assert path_of(auto) == "control" and auto.ready()
        assert await auto.release(job()) is JobResult.SENT
        with pytest.raises(PermanentReleaseError) as caught:
            await auto.release(job("r2", cause="unreachable"))
        assert caught.value.reason == "no_path"
    finally:
        await auto.close()


async def test_probes_repeat_at_the_interval(registry: CollectorRegistry) -> None:
    control = FakeControl()
    auto = AutoReleaser(
        Config(release="auto", auto_probe_interval=0.01),
        _no_version,
        registry,
        control=control,
        nixl=FakeNixl(),
    )
    await auto.start()
    try:
        control.probe_answer = "absent"
        deadline = time.monotonic() + 5
        while path_of(auto) != "nixl" or control.probes < 3:
            assert time.monotonic() < deadline, "the probe loop did not run"
            await asyncio.sleep(0.005)
    finally:
        await auto.close()
    assert control.closed and auto._task is None
