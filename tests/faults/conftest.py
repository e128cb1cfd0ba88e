"""Fixtures of the fault scenarios: the shared simulators and one ``Scene`` per scenario.

The ``slow_faults`` marker (registered here too, so the directory works on its
own) marks the long scenarios run by ``make faults``; they are deselected
unless the ``-m`` expression names the marker, so a plain ``pytest`` (``make
test``) runs the fast ones only, and those in ``make test``'s serial run.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.faults.cluster import Backends, backends

SLOW = "slow_faults"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", f"{SLOW}: long fault scenarios and soaks (make faults)")
    config.addinivalue_line("markers", "netns_first: runs before any other test of the session")


@pytest.hookimpl(tryfirst=True)  # before ``-m`` selects: the serial marker added here counts
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Every scenario judges P's evidence against deadlines and leases: beside the parallel part's
    # test processes on two cores, D's reads and the sidecar's releases came late. make test runs
    # them in its serial part, one after another in one process (one xdist group) beside at most
    # one other serial test; they share one set of simulators (``cluster``).
    here = Path(__file__).parent
    for item in items:
        if here in item.path.parents:
            item.add_marker(pytest.mark.serial)
            item.add_marker(pytest.mark.xdist_group("faults"))
    if SLOW in (config.getoption("markexpr", "") or ""):
        # The network-namespace partition goes first: UCX in a process keeps the network
        # interfaces it saw when the process's first UCX context was made (observed here), so a
        # NIXL agent made after an earlier test's cannot use the veth the scenario adds, and its
        # notifications to P would fail for a reason that is the test's, not the sidecar's.
        items.sort(key=lambda item: 0 if item.get_closest_marker("netns_first") else 1)
        return
    slow = [item for item in items if item.get_closest_marker(SLOW)]
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = [item for item in items if not item.get_closest_marker(SLOW)]


@pytest.fixture(scope="session")
def cluster() -> Iterator[Backends]:
    with backends() as started:
        yield started
