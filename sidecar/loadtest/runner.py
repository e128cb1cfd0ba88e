"""One whole load-test run: probe, drive, drain, collect, judge, report.

``run_loadtest(config, workload)`` opens one aiohttp session (no proxy from
the environment), learns the model and how to probe P, snapshots P's and
the sidecar's counters, samples P while the driver runs the flows, then
waits (up to ``drain_timeout``) until P holds no pinned blocks, the
sidecar's release queue is empty and P's notification counters have been
still for a moment, so late releases are counted. It then reads D's and P's
per-request records where the simulators offer them, judges the run and
returns the report dict. The demo calls it twice with its own workload.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from typing import Any, TextIO

import aiohttp
import msgspec

from sidecar.loadtest.config import LoadConfig
from sidecar.loadtest.driver import drive
from sidecar.loadtest.flow import FlowResult, run_flow
from sidecar.loadtest.probes import (
    PrefillProbe,
    PSnapshot,
    d_log,
    detect_prefill_probe,
    first_model,
    p_requests,
    sidecar_counters,
)
from sidecar.loadtest.progress import Progress, Tally
from sidecar.loadtest.report import RunData, Series, build_report, deltas
from sidecar.loadtest.verdict import Evidence, judge
from sidecar.loadtest.workload import Workload, plain_workload

QUIET_SECONDS = 0.3  # P's counters unchanged this long: no release is still on its way
DRAIN_POLL = 0.05
READY_POLL = 1.0  # seconds between two readiness checks (pods load models for minutes)


class ReadyTimeout(TimeoutError):
    """P, D or the sidecar did not become ready within ``ready_timeout``."""


MAX_CHECKED = 20_000  # per-request look-ups on P at most
_PROBE_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError, OSError, msgspec.DecodeError, KeyError)


async def run_loadtest(
    config: LoadConfig, workload: Workload | None = None, progress_stream: TextIO | None = None
) -> dict[str, Any]:
    """Run the load described by ``config`` and return its report (``report.build_report``)."""
    connector = aiohttp.TCPConnector(limit=config.max_inflight + 16)
    timeout = aiohttp.ClientTimeout(total=config.timeout)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, trust_env=False) as session:
        run = _Run(config, workload or plain_workload(), session, progress_stream)
        return await run.execute()


class _Run:
    def __init__(
        self, config: LoadConfig, workload: Workload, session: aiohttp.ClientSession, stream: TextIO | None
    ) -> None:
        self.config, self.workload, self.session = config, workload, session
        self.progress = Progress(config.progress, config.duration, config.max_requests, stream)
        self.tally = Tally()
        self.series = Series([], [], [])
        self.flows: list[FlowResult] = []
        self.run_id = f"lt{config.seed}-{secrets.token_hex(3)}"
        self.model = ""  # the model asked for (P's first, unless given)
        self.d_model: str | None = None

    async def execute(self) -> dict[str, Any]:
        config = self.config
        if config.ready_timeout > 0:
            await self._wait_ready()
        model = self.model = config.model or await first_model(self.session, config.prefill_url)
        self.d_model = await self._d_model()
        probe = await detect_prefill_probe(self.session, config.prefill_url, config.prefill_probe)
        sidecar_before = await self._sidecar()
        before = await probe.snapshot()
        self.tally.blocks_total = before.blocks_total
        t0 = time.monotonic()
        background = [
            asyncio.create_task(self._sample(probe, t0)),
            asyncio.create_task(self.progress.run(self.tally)),
        ]
        try:
            stats = await drive(config, lambda index: self._flow(model, index, t0))
            elapsed = time.monotonic() - t0
            await self._drain(probe)
        finally:
            for task in background:
                task.cancel()
            await asyncio.gather(*background, return_exceptions=True)
            self.progress.finish(self.tally)
        after = await probe.snapshot()
        evidence = await self._evidence(probe, before, after, sidecar_before)
        run = RunData(config, model, stats, elapsed, self.series, before, after, evidence, judge(evidence))
        return build_report(run)

    async def _flow(self, model: str, index: int, t0: float) -> None:
        plan = self.workload.plan(self.config, model, self.run_id, index)
        self.tally.started += 1
        result = await run_flow(self.session, plan, self.config.prefill_url, t0)
        self.flows.append(result)
        self.tally.outcomes[result.outcome] += 1

    async def _wait_ready(self) -> None:
        """Poll P's and D's ``/health`` and the sidecar's ``/readyz`` until each answers 200;
        raise ``ReadyTimeout`` naming the ones that did not within ``ready_timeout``."""
        urls = [self.config.prefill_url + "/health", self.config.decode_url + "/health"]
        if self.config.sidecar_admin_url:
            urls.append(self.config.sidecar_admin_url + "/readyz")
        deadline = time.monotonic() + self.config.ready_timeout
        pending = list(urls)
        while pending:
            for url in list(pending):
                try:
                    async with self.session.get(url) as response:
                        if response.status == 200:
                            pending.remove(url)
                except _PROBE_ERRORS:
                    pass
            if pending and time.monotonic() >= deadline:
                raise ReadyTimeout(f"not ready after {self.config.ready_timeout:.0f} s: {', '.join(pending)}")
            if pending:
                await asyncio.sleep(READY_POLL)

    async def _d_model(self) -> str | None:
        """The first model D lists (through the sidecar, which passes /v1/models on), to name a
        model mismatch in the verdict; None when D does not say."""
        try:
            return await first_model(self.session, self.config.decode_url)
        except (*_PROBE_ERRORS, IndexError, TypeError):
            return None

    async def _sidecar(self) -> dict[str, float] | None:
        if not self.config.sidecar_admin_url:
            return None
        return await sidecar_counters(self.session, self.config.sidecar_admin_url)

    async def _sample(self, probe: PrefillProbe, t0: float) -> None:
        while True:
            try:
                snap = await probe.snapshot()
            except _PROBE_ERRORS:
                snap = None
            if snap is not None:
                self.series.t.append(round(time.monotonic() - t0, 3))
                self.series.blocks.append(_blocks(snap))
                self.series.pinned_requests.append(snap.pinned_requests)
                self.tally.blocks_in_use = snap.blocks_in_use
            await asyncio.sleep(self.config.sample_interval)

    async def _drain(self, probe: PrefillProbe) -> None:
        """Wait until P is idle, the sidecar's queue empty and P's counters still."""
        deadline = time.monotonic() + self.config.drain_timeout
        last: tuple[Any, ...] | None = None
        still_since = time.monotonic()
        while time.monotonic() < deadline:
            try:
                snap = await probe.snapshot()
                sidecar = await self._sidecar()
            except _PROBE_ERRORS:
                await asyncio.sleep(DRAIN_POLL)
                continue
            key = (sorted(snap.counters.items()), snap.notifs_per_rank, snap.pinned_requests)
            if key != last:
                last, still_since = key, time.monotonic()
            idle = _idle(snap) and (sidecar or {}).get("queue_depth", 0.0) == 0
            if idle and time.monotonic() - still_since >= QUIET_SECONDS:
                return
            await asyncio.sleep(DRAIN_POLL)

    async def _evidence(
        self,
        probe: PrefillProbe,
        before: PSnapshot,
        after: PSnapshot,
        sidecar_before: dict[str, float] | None,
    ) -> Evidence:
        sidecar_after = await self._sidecar()
        ids = {flow.request_id for flow in self.flows if flow.decode_status}
        log = await d_log(self.session, self.config.decode_url, ids) if ids else None
        records = None
        if probe.kind == "simulator":
            p_ids = [flow.p_request_id for flow in self.flows if flow.p_request_id][:MAX_CHECKED]
            records = await p_requests(self.session, self.config.prefill_url, p_ids)
        return Evidence(
            flows=sorted(self.flows, key=lambda flow: flow.index),
            p_kind=probe.kind,
            p_delta=deltas(before.counters, after.counters),
            d_log=log,
            p_requests=records,
            sidecar_delta=(
                deltas(sidecar_before, sidecar_after)
                if sidecar_before is not None and sidecar_after is not None
                else None
            ),
            max_rejected_share=self.config.max_rejected_share,
            p_model=self.model,
            d_model=self.d_model,
        )


def _blocks(snap: PSnapshot) -> float | None:
    """Blocks in use; without P's pool size, the per cent of P's KV cache in use."""
    if snap.blocks_in_use is not None or snap.usage is None:
        return snap.blocks_in_use
    return snap.usage * 100


def _idle(snap: PSnapshot) -> bool:
    """P holds nothing, by the most precise figure it reports (with none, its counters decide)."""
    if snap.pinned_requests is not None:
        return snap.pinned_requests == 0
    if snap.blocks_in_use is not None:
        return snap.blocks_in_use == 0
    if snap.usage is not None:  # vLLM's /metrics gives only the fraction of the pool in use
        return snap.usage == 0
    return True
