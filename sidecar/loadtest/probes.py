"""What the load generator reads from P, D and the sidecar besides the answers.

P is probed one of two ways, chosen once by ``detect_prefill_probe``: the
simulator's ``GET /stats`` (exact blocks in use, pinned requests and the
notification counters), or any P's ``GET /metrics`` in Prometheus text,
parsed with prometheus_client's parser: a real vLLM's
``vllm:kv_cache_usage_perc`` (``vllm:gpu_cache_usage_perc`` before 0.10)
times ``num_gpu_blocks`` of ``vllm:cache_config_info``, and its ``vllm:nixl_*``
counters where the release exports them. The sidecar's counters come from
its admin ``/metrics``; D's request log and P's per-request record from the
simulators' ``/sim`` endpoints when they exist.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

import aiohttp
import msgspec
from prometheus_client.parser import text_string_to_metric_families

_DECODER = msgspec.json.Decoder()
SIM_PREFIX = "kvr_sim_prefill_"
#: Sim counters on ``/metrics`` -> the ``/stats`` names the report uses.
_SIM_COUNTERS = {
    "pinned_block_seconds_total": "pinned_block_seconds",
    "refused_no_blocks_total": "refused_no_blocks",
    "notifs_unknown_total": "notifs_unknown",
    "requests_pinned_total": "requests_pinned",
}
STAT_COUNTERS = (
    "pinned_block_seconds",
    "freed_by_notification",
    "freed_by_expiry",
    "refused_no_blocks",
    "notifs_unknown",
    "requests_pinned",
)


@dataclass
class PSnapshot:
    """P at one moment. Counters are cumulative; absent ones are simply missing."""

    blocks_in_use: float | None = None
    blocks_total: float | None = None
    usage: float | None = None  # fraction of the pool in use
    pinned_requests: int | None = None
    counters: dict[str, float] = field(default_factory=dict)
    notifs_per_rank: list[int] | None = None


class PrefillProbe(Protocol):
    """Reads P's state; ``kind`` is ``simulator`` or ``prometheus``."""

    kind: str

    async def snapshot(self) -> PSnapshot:
        """P's current state (raises aiohttp/msgspec errors when P does not answer)."""


async def _get(session: aiohttp.ClientSession, url: str) -> tuple[int, bytes]:
    async with session.get(url, timeout=aiohttp.ClientTimeout(total=5)) as response:
        return response.status, await response.read()


class SimProbe:
    """The prefill simulator's ``GET /stats``."""

    kind = "simulator"

    def __init__(self, session: aiohttp.ClientSession, url: str) -> None:
        self._session, self._url = session, url

    async def snapshot(self) -> PSnapshot:
        _, body = await _get(self._session, self._url + "/stats")
        return sim_snapshot(_DECODER.decode(body))


def sim_snapshot(stats: dict[str, Any]) -> PSnapshot:
    """A ``PSnapshot`` from the simulator's ``/stats`` document."""
    total = float(stats["blocks_total"])
    return PSnapshot(
        blocks_in_use=float(stats["blocks_in_use"]),
        blocks_total=total,
        usage=float(stats["blocks_in_use"]) / total if total else None,
        pinned_requests=int(stats["pinned_requests"]),
        counters={name: float(stats[name]) for name in STAT_COUNTERS if name in stats},
        notifs_per_rank=[int(n) for n in stats.get("notifs_per_rank", [])],
    )


class PrometheusProbe:
    """Any P's ``GET /metrics`` (a real vLLM, or the simulator's own exposition)."""

    kind = "prometheus"

    def __init__(self, session: aiohttp.ClientSession, url: str) -> None:
        self._session, self._url = session, url

    async def snapshot(self) -> PSnapshot:
        _, body = await _get(self._session, self._url + "/metrics")
        return prometheus_snapshot(body.decode(errors="replace"))


def _samples(text: str) -> Iterable[tuple[str, dict[str, str], float]]:
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            yield sample.name, sample.labels, float(sample.value)


def prometheus_snapshot(text: str) -> PSnapshot:
    """A ``PSnapshot`` from Prometheus text: vLLM's names, or the simulator's (which also mirrors
    two of vLLM's: read from its own, exact series then)."""
    snap = PSnapshot()
    usages: list[float] = []
    samples = list(_samples(text))
    simulated = any(name.startswith(SIM_PREFIX) for name, _, _ in samples)
    for name, labels, value in samples:
        if simulated and not name.startswith(SIM_PREFIX):
            continue
        if name in ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"):
            usages.append(value)
        elif name == "vllm:cache_config_info" and labels.get("num_gpu_blocks", "").isdigit():
            snap.blocks_total = float(labels["num_gpu_blocks"])
        elif name.startswith("vllm:nixl_") and not name.endswith(("_bucket", "_created")):
            key = name + _label_text(labels)
            snap.counters[key] = snap.counters.get(key, 0.0) + value
            if "unknown" in name or "unrecognized" in name:
                snap.counters["notifs_unknown"] = snap.counters.get("notifs_unknown", 0.0) + value
        elif name.startswith(SIM_PREFIX):
            _sim_sample(snap, name[len(SIM_PREFIX) :], labels, value)
    if usages:
        snap.usage = sum(usages) / len(usages)  # one gauge per engine (data parallel)
        if snap.blocks_total is not None:
            snap.blocks_in_use = snap.usage * snap.blocks_total
    return snap


def _sim_sample(snap: PSnapshot, name: str, labels: dict[str, str], value: float) -> None:
    if name == "blocks_in_use":
        snap.blocks_in_use = value
    elif name == "blocks_total":
        snap.blocks_total = value
    elif name == "pinned_requests":
        snap.pinned_requests = int(value)
    elif name == "freed_total":
        snap.counters[f"freed_by_{labels.get('cause', '?')}"] = value
    elif name in _SIM_COUNTERS:
        snap.counters[_SIM_COUNTERS[name]] = value
    if snap.blocks_in_use is not None and snap.blocks_total:
        snap.usage = snap.blocks_in_use / snap.blocks_total


def _label_text(labels: dict[str, str]) -> str:
    shown = {k: v for k, v in labels.items() if k not in ("model_name", "engine")}
    return "{" + ",".join(f"{k}={v}" for k, v in sorted(shown.items())) + "}" if shown else ""


async def detect_prefill_probe(session: aiohttp.ClientSession, url: str, mode: str = "auto") -> PrefillProbe:
    """``stats``/``metrics`` as asked; ``auto``: the simulator's ``/stats`` when P serves it, else
    its Prometheus ``/metrics``."""
    if mode != "auto":
        return SimProbe(session, url) if mode == "stats" else PrometheusProbe(session, url)
    try:
        status, body = await _get(session, url + "/stats")
        if status == 200 and isinstance(_DECODER.decode(body), dict) and b'"blocks_in_use"' in body:
            return SimProbe(session, url)
    except (TimeoutError, aiohttp.ClientError, msgspec.DecodeError):
        pass
    return PrometheusProbe(session, url)


async def sidecar_counters(session: aiohttp.ClientSession, admin_url: str) -> dict[str, float]:
    """The sidecar's release counters, flattened: ``releases.sent``, ``rejections.injected``..."""
    _, body = await _get(session, admin_url + "/metrics")
    return sidecar_counters_from_text(body.decode(errors="replace"))


def sidecar_counters_from_text(text: str) -> dict[str, float]:
    """``kvr_releases_total{result}`` -> ``releases.<result>`` (summed over strategies), and
    likewise rejections by cause, not-released by outcome, injected, the blocks released and the
    pinned block-seconds the sidecar estimates it saved, and the queue depth."""
    out: dict[str, float] = {}
    totals = {
        "kvr_released_blocks_total": "released_blocks",
        "kvr_pinned_block_seconds_saved_total": "block_seconds_saved",
    }
    keys = {
        "kvr_releases_total": ("releases", "result"),
        "kvr_rejections_total": ("rejections", "cause"),
        "kvr_not_released_total": ("not_released", "outcome"),
        "kvr_injected_total": ("injected", "status_class"),
    }
    for name, labels, value in _samples(text):
        if name in keys:
            prefix, label = keys[name]
            key = f"{prefix}.{labels.get(label, '?')}"
            out[key] = out.get(key, 0.0) + value
        elif name in totals:
            out[totals[name]] = out.get(totals[name], 0.0) + value
        elif name == "kvr_release_queue_depth":
            out["queue_depth"] = value
    return out


async def first_model(session: aiohttp.ClientSession, url: str) -> str:
    """The first model ``GET /v1/models`` lists."""
    _, body = await _get(session, url + "/v1/models")
    data = _DECODER.decode(body)
    return str(data["data"][0]["id"])


async def d_log(session: aiohttp.ClientSession, decode_url: str, ids: set[str]) -> dict[str, Any] | None:
    """The decode simulator's ``/sim/log`` entries for ``ids`` (through the sidecar too),
    or None when D is not the simulator."""
    try:
        status, body = await _get(session, decode_url + "/sim/log")
        entries = _DECODER.decode(body) if status == 200 else None
    except (TimeoutError, aiohttp.ClientError, msgspec.DecodeError):
        return None
    if not isinstance(entries, list):
        return None
    return {e["request_id"]: e for e in entries if isinstance(e, dict) and e.get("request_id") in ids}


async def p_requests(
    session: aiohttp.ClientSession, prefill_url: str, ids: list[str], parallel: int = 16
) -> dict[str, dict[str, Any] | None]:
    """The prefill simulator's ``/sim/requests/{id}`` for each id (None: P does not know it)."""
    gate = asyncio.Semaphore(parallel)

    async def one(request_id: str) -> tuple[str, dict[str, Any] | None]:
        async with gate:
            status, body = await _get(session, f"{prefill_url}/sim/requests/{request_id}")
        return request_id, _DECODER.decode(body) if status == 200 else None

    return dict(await asyncio.gather(*(one(i) for i in ids)))
