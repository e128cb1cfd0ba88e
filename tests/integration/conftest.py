"""Fixtures: real uvicorn servers on ephemeral loopback ports (readiness polled)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from sidecar.app import Deps, ProxyApp, create_admin_app, create_app
from sidecar.config import Config
from sidecar.release.stub import StubReleaser
from sidecar.server.host import server_options
from sidecar.server.limits import ServerLimits
from tests.support.servers import ServerThread, serve
from tests.support.until import until


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


class Recording(StubReleaser):
    """The ``dry-run`` recorder standing in for the configured strategy: the proxy behaves as for
    that strategy (its releases free P's blocks, ``http`` and ``auto`` keep the raw parameters)."""

    def __init__(self, keep: int, frees: bool, keeps_raw: bool) -> None:
        super().__init__("dry-run", keep)
        self.frees, self.checked, self.keeps_raw = frees, frees, keeps_raw  # type: ignore[misc]


class Sidecar:
    """A running sidecar (proxy + admin on one loop) with a recording releaser."""

    def __init__(self, server: ServerThread, app: ProxyApp, releaser: StubReleaser) -> None:
        self.server, self.app, self.releaser = server, app, releaser
        self.url, self.admin_url = server.urls[0], server.urls[1]

    @property
    def registry(self) -> CollectorRegistry:
        assert self.app.runtime is not None
        return self.app.runtime.metrics.registry

    def sample(self, name: str, **labels: str) -> float:
        return self.registry.get_sample_value(name, labels) or 0.0

    def wait_idle(self, timeout: float = 5.0) -> bool:
        """Wait until no request is in flight (each was classified and counted); whether none is."""
        idle = lambda: not self.sample("kvr_inflight_requests")  # noqa: E731
        return until(idle, "no request in flight", timeout, 0.002, fail=False)

    def released(self) -> list[str]:
        return [job.params.remote_request_id or job.request_id for job in self.releaser.recorded]

    def wait_released(self, count: int, timeout: float = 5.0) -> list[str]:
        """The released requests' ids once ``count`` were released, or all there are after ``timeout``."""
        until(lambda: len(self.releaser.recorded) >= count, f"{count} releases", timeout, 0.002, fail=False)
        return self.released()

    def settle(self) -> None:
        """Wait until every submitted job finished (the queue is empty and idle)."""
        assert self.app.runtime is not None
        assert self.server.call(self.app.runtime.pipeline.flush(5.0))


#: ``retried_statuses=SHIPPED`` leaves the setting out, so ``Config``'s own default (502, 503, 504)
#: applies, as ``serve`` ships it; ``NONE`` is the value of a deployment nothing in front retries.
SHIPPED = "shipped"
NONE = ("none",)
RETRIED = pytest.mark.parametrize("retried", [SHIPPED, NONE], ids=["retried-default", "retried-none"])


def retried_statuses(settings: dict[str, Any]) -> dict[str, Any]:
    """``settings`` with ``retried_statuses`` as the tests want it: ``NONE`` unless given, and left
    out for ``SHIPPED``."""
    settings = {"retried_statuses": NONE, **settings}
    if settings["retried_statuses"] == SHIPPED:
        del settings["retried_statuses"]
    return settings


@contextmanager
def run_sidecar(decode_url: str, record: bool = False, **settings: Any) -> Iterator[Sidecar]:
    """A sidecar in front of ``decode_url``; ``dry-run`` (recording) unless ``release`` is given.

    ``record``: the recording releaser stands in for the configured strategy (the proxy still
    behaves as configured for it, e.g. keeping raw parameters for ``http``).
    """
    # Tests talk to the sidecar directly: nothing in front retries its answers on another pod
    # (tests/faults/test_mesh_retries.py runs real retrying proxies with the default); the tests
    # whose outcome depends on it run under both values (``RETRIED``).
    settings = retried_statuses({"release": "dry-run", "log_level": "warning", **settings})
    config = Config(decode_url=decode_url, **settings)
    frees, keeps_raw = config.release in ("nixl", "http", "auto"), config.release in ("http", "auto")
    releaser = Recording(keep=100_000, frees=frees, keeps_raw=keeps_raw)
    injected = releaser if record or config.release == "dry-run" else None
    app = create_app(config, Deps(releaser=injected, registry=CollectorRegistry()))
    # The production protocol (sidecar.server.protocol, as sidecar.server.serve runs it) on the proxy port,
    # not the test servers' default h11: what a client meets is what the sidecar ships.
    options = server_options(ServerLimits.of(config))
    with serve(app, create_admin_app(app), server_header=False, date_header=False, **options) as server:
        yield Sidecar(server, app, releaser)


@pytest.fixture
def sidecar_factory() -> Callable[..., Any]:
    return run_sidecar


def kv_params(rid: str, **changes: Any) -> dict[str, Any]:
    """``kv_transfer_params`` as P answers them (vLLM 0.13.0+ pull mode, TP 1), with ``changes``."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": "p-engine",
        "remote_request_id": rid,
        "remote_host": "10.0.0.7",
        "remote_port": 5600,
        "remote_block_ids": [[1, 2]],
        "tp_size": 1,
        **changes,
    }
