"""Two decode pods behind nginx, on real engines: the shipped defaults where a front retries.

``python -m tests.e2e --two-pods`` starts P and two decode engines, puts a
sidecar with the shipped defaults (``defaults`` mode: ``retried_statuses``
502,503,504) in front of each D, and nginx in front of both sidecars with
``deploy/mesh/nginx-decode.conf`` as shipped (its two pods' addresses swapped
for the sidecars' loopback ports; ``tests.faults.fronts``). Every request
goes to nginx. Then, each judged from P's evidence like any scenario:

1. pod 1's D is stopped. Admitted requests (completion, chat, stream): pod
   1's sidecar answers 503, leaves it (a retried status), nginx retries on pod
   2, whose D reads P's blocks: the answer equals D's own, P frees the blocks
   at D's read, and no notification reaches P for blocks it no longer held.
   (nginx round-robins, and after a failure avoids pod 1 for 10 s: the run is
   an error unless pod 1 left at least one of these requests to the retry.)
2. Rejections while pod 1 is down: freed at once, by pod 2's sidecar
   (before D's handler) or pod 2's D (its handler).
3. Both pods' D stopped: nginx answers the second 503 (or its own 502 while
   it still avoids pod 1, which failed within its 10 s ``fail_timeout``, and
   so finds no second pod to try); neither sidecar may
   release (nginx retried the first), so P's lease frees the blocks: the
   scenario measures how long they stay pinned, the setting's cost
   (``retried_statuses none`` would free them at once, but is unsafe with a
   front that retries).

The sidecars' counts are summed (``Front``); D's reads and the "D alone"
answers are pod 2's D's (pod 1's is stopped before the first scenario).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import httpx

from tests.e2e.cluster import Engines, warm_up
from tests.e2e.engines import Processes
from tests.e2e.evidence import by_label
from tests.e2e.report import Report, Row
from tests.e2e.runner import Runner
from tests.e2e.scenarios import SIDECAR_SCENARIOS, Mode, Scenario
from tests.e2e.sidecars import Peers, Proxy, SidecarProcess, start_sidecar
from tests.faults.fronts import front

#: How a row is run (``tests.e2e.__main__.run_row``: the retry rule and the printed line).
RunRow = Callable[[Runner, Mode, Scenario, Proxy], Row]

#: With pod 1's D stopped: admitted requests and rejections, by key.
POD1_DOWN = ("admit", "admit-chat", "admit-stream", "pre-validation", "stream-dp-rank", "handler-temperature")
#: Both pods' D stopped.
BOTH_DOWN = ("down",)


@dataclass
class Front:
    """nginx in front of the sidecars: requests to ``url``, the sidecars' counts summed."""

    url: str
    sidecars: list[SidecarProcess]

    def metrics(self, client: httpx.Client) -> str:
        return "\n".join(sidecar.metrics(client) for sidecar in self.sidecars)


#: What three CPU engines need at least (each about 1.7 GB at peak here, P and D 3.5 GB together).
MEMORY_GB = 6.0


def enough_memory(meminfo: Path = Path("/proc/meminfo")) -> None:
    """``RuntimeError`` when the machine has too little memory available for three engines."""
    for line in meminfo.read_text().splitlines():
        if line.startswith("MemAvailable:"):
            available = int(line.split()[1]) / 1024 / 1024
            if available < MEMORY_GB:
                raise RuntimeError(
                    f"two pods need {MEMORY_GB:g} GB available for three engines; {available:.1f} GB is"
                )
            return


def scenarios(keys: tuple[str, ...]) -> list[Scenario]:
    by_key = {scenario.key: scenario for scenario in SIDECAR_SCENARIOS}
    return [by_key[key] for key in keys]


def run_two_pods(
    runner: Runner,
    processes: Processes,
    engines: Engines,
    peers: Peers,
    out: Path,
    report: Report,
    run_row: RunRow,
) -> None:
    """The two-pod scenarios (see the module docstring); the rows go to ``report``."""
    if engines.d is None or not engines.more_d:
        report.skipped.append("two pods: the harness starts the engines only with --engine-python")
        return
    d2_url, d2 = engines.more_d[0]
    target = runner.target
    pods = [
        start_sidecar(processes, "defaults", peers, out / "logs" / "sidecar-pod1.log"),
        start_sidecar(processes, "defaults", replace(peers, d_url=d2_url), out / "logs" / "sidecar-pod2.log"),
    ]
    with contextlib.ExitStack() as stack:
        url = stack.enter_context(front("nginx", [pod.url.removeprefix("http://") for pod in pods]))
        nginx = Front(url, pods)
        target.d_url = d2_url  # D's reads and "D alone": pod 2's D from here on
        report.info["two_pods_warm_up_seconds"] = round(warm_up(target, runner.client), 1)
        processes.stop(engines.d)
        left = _retryable(pods[0], runner.client)
        for scenario in scenarios(POD1_DOWN):
            report.rows.append(run_row(runner, "pods", scenario, nginx))
        left = _retryable(pods[0], runner.client) - left
        report.info["two_pods_pod1_left_for_retry"] = left
        if not left:  # nginx never tried pod 1: nothing above went through its retry
            raise RuntimeError("nginx sent no request to pod 1 after its D stopped: no retry was exercised")
        processes.stop(d2)
        target.d_up = False
        for scenario in scenarios(BOTH_DOWN):
            row = run_row(runner, "pods", scenario, nginx)
            report.rows.append(row)
            report.info["two_pods_both_down_pinned_seconds"] = row.evidence.freed_after


def _retryable(sidecar: SidecarProcess, client: httpx.Client) -> float:
    """The sidecar's rejections left to a retry on another pod (``kvr_not_released_total``)."""
    return by_label(sidecar.metrics(client), "kvr_not_released_total", "outcome").get("retryable", 0.0)
