"""The integration suite's fixtures: D served for a module, the fake D and the sidecar's workers.

The servers are real (uvicorn on ephemeral loopback ports, readiness polled); how a test starts a
sidecar is ``tests.support.runner``'s.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from sidecar.sim.decode import create_decode_app
from sidecar.sim.decode.config import DecodeSimConfig
from sidecar.sim.servers import ServerThread, serve
from tests.integration.workers import FakeDecode, Workers, start_workers
from tests.support.runner import (
    run_sidecar,
)


@pytest.hookimpl(tryfirst=True)  # before ``-m`` selects: the serial marker added here counts
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests marked ``netns`` run serially and last.

    They add a veth to this host's namespace for as long as they run. UCX lists a host's interfaces
    when a process makes its first context and keeps that list: a NIXL agent made meanwhile, in
    another test process or later in this one, tries the veth after it is gone and fails
    (``NIXL_ERR_BACKEND``, "Destination is unreachable"; observed under pytest-xdist).
    """
    for item in items:
        if item.get_closest_marker("netns"):
            item.add_marker(pytest.mark.serial)
        if item.get_closest_marker("serial") and not item.get_closest_marker("xdist_group"):
            # make test's serial part runs on several processes (--dist loadgroup): a module's tests stay
            # in one, so a module-scoped run (a bench, the demo) is made once.
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))
    items.sort(key=lambda item: 1 if item.get_closest_marker("netns") else 0)


@pytest.fixture
def sidecar_factory() -> Callable[..., Any]:
    return run_sidecar


@pytest.fixture(scope="module")
def decode(request: pytest.FixtureRequest) -> Iterator[ServerThread]:
    """The decode simulator for the requesting module, as its ``DECODE`` configures it (else the
    simulator's defaults)."""
    config = getattr(request.module, "DECODE", DecodeSimConfig(port=0))
    with serve(create_decode_app(config)) as server:
        yield server


@pytest.fixture
def fake_decode() -> Iterator[tuple[FakeDecode, ServerThread]]:
    """A fake D whose answers and control endpoint a test holds (``gate``, ``control_gate``)."""
    fake = FakeDecode()
    with serve(fake.app()) as server:
        yield fake, server
        fake.gate.set()
        fake.control_gate.set()


@pytest.fixture
def workers(fake_decode: tuple[FakeDecode, ServerThread], tmp_path: Path) -> Iterator[Workers]:
    """The sidecar with two workers (``KVR_WORKERS=2``) in front of the fake D."""
    yield from start_workers(fake_decode[1].url, tmp_path)
