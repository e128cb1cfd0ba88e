"""The admin port of a sidecar run as several worker processes (``workers``): one port for them all.

Each worker serves its own admin app (``sidecar.app.admin``) on a Unix socket
in the supervisor's private directory; the supervisor's admin port asks every
worker and answers for the whole:

* ``/readyz``: 200 only when every worker is alive and answers ready (and the
  supervisor is not draining); each check is true when it is true on every
  worker (``draining`` when any worker drains); ``workers`` lists each one.
* ``/metrics``: the workers' families merged under the same names and labels:
  counters, histograms and most gauges summed; gauges that each worker reports
  about a thing they share (the shared ledger's size, readiness, D's state, the
  release path) by their minimum or maximum. When a worker dies, what it had
  counted at the last scrape stays in the totals (so they never go backwards),
  and what it counted after that scrape is lost.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry
from prometheus_client.exposition import generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

ASK_TIMEOUT = 2.0
# Gauges every worker reports about one shared thing: the fleet's value is the lowest or highest.
LOWEST = frozenset(
    {"kvr_ready", "kvr_releases_enabled", "kvr_decode_can_notify", "process_start_time_seconds",
     "process_max_fds"}
)  # fmt: skip
HIGHEST = frozenset(
    {"kvr_release_ledger_size", "kvr_release_targets", "kvr_release_path", "kvr_nixl_handshake_cache_engines",
     "python_info"}
)  # fmt: skip
_ACCUMULATING = ("counter", "histogram", "summary")

SampleKey = tuple[str, tuple[tuple[str, str], ...]]


@dataclass(frozen=True, slots=True)
class Member:
    """One worker as the admin port sees it."""

    index: int
    pid: int
    admin_socket: str
    alive: bool


class Fleet(Protocol):
    """What the admin port reads of the supervisor (``registry``: its own metrics)."""

    size: int
    draining: bool
    totals: Totals
    registry: CollectorRegistry

    def members(self) -> Sequence[Member]: ...


async def ask(path: str, route: str, timeout: float = ASK_TIMEOUT) -> tuple[int, bytes]:  # noqa: ASYNC109
    """GET ``route`` from a worker's admin app on its Unix socket: (status, body)."""
    async with asyncio.timeout(timeout):
        reader, writer = await asyncio.open_unix_connection(path)
        try:
            writer.write(f"GET {route} HTTP/1.1\r\nhost: worker\r\nconnection: close\r\n\r\n".encode())
            data = await reader.read()
        finally:
            writer.close()
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body


class _Families:
    """Families to expose, in the order first seen (``generate_latest`` reads ``collect``)."""

    def __init__(self, families: Iterable[Metric]) -> None:
        self._families = list(families)

    def collect(self) -> list[Metric]:
        return self._families


class Totals:
    """Merges the workers' ``/metrics`` texts; keeps what dead workers had counted."""

    def __init__(self) -> None:
        self._last: dict[int, list[Metric]] = {}
        self._retired: dict[SampleKey, float] = {}

    def retire(self, index: int) -> None:
        """Worker ``index`` died: its counts at the last scrape stay in the totals."""
        for family in self._last.pop(index, []):
            if family.type in _ACCUMULATING:
                for sample in family.samples:
                    if not sample.name.endswith("_created"):
                        key = (sample.name, tuple(sorted(sample.labels.items())))
                        self._retired[key] = self._retired.get(key, 0.0) + sample.value

    def merge(self, texts: dict[int, str]) -> bytes:
        families: dict[str, Metric] = {}
        values: dict[str, dict[SampleKey, float]] = {}
        for index, text in texts.items():
            parsed = list(text_string_to_metric_families(text))
            self._last[index] = parsed
            for family in parsed:
                if family.name not in families:
                    families[family.name] = Metric(family.name, family.documentation, family.type)
                    values[family.name] = {}
                merged = values[family.name]
                for sample in family.samples:
                    key = (sample.name, tuple(sorted(sample.labels.items())))
                    old = merged.get(key)
                    new = sample.value
                    merged[key] = new if old is None else _combine(family.name, key[0], old, new)
        for name, family in families.items():
            merged = values[name]
            if family.type in _ACCUMULATING:
                for key in merged:
                    merged[key] += self._retired.get(key, 0.0)
            for (sample_name, labels), value in merged.items():
                family.add_sample(sample_name, dict(labels), value)
        return generate_latest(_Families(families.values()))


def _combine(family: str, sample: str, old: float, new: float) -> float:
    if sample.endswith("_created") or family in LOWEST:
        return min(old, new)
    if family in HIGHEST:
        return max(old, new)
    return old + new


def create_fleet_admin_app(fleet: Fleet) -> Starlette:
    """The supervisor's admin app (module docstring)."""

    async def healthz(request: Request) -> Response:
        return PlainTextResponse("ok")

    async def readyz(request: Request) -> Response:
        if fleet.draining:
            return JSONResponse({"ready": False, "checks": {"draining": True}}, status_code=503)
        members = fleet.members()
        answers = await asyncio.gather(
            *(ask(m.admin_socket, "/readyz") for m in members), return_exceptions=True
        )
        checks: dict[str, bool] = {}
        workers: list[dict[str, object]] = []
        detail: object = None
        for member, answer in zip(members, answers, strict=True):
            entry: dict[str, object] = {"worker": member.index, "pid": member.pid, "ready": False}
            workers.append(entry)
            if not member.alive or isinstance(answer, BaseException):
                entry["error"] = "not running" if not member.alive else f"no answer ({answer!r})"
                continue
            status, raw = answer
            doc = json.loads(raw)
            entry["ready"], entry["checks"] = status == 200, doc.get("checks", {})
            detail = detail or doc.get("release")
            for name, value in doc.get("checks", {}).items():
                if name == "draining":
                    checks[name] = checks.get(name, False) or bool(value)
                else:
                    checks[name] = checks.get(name, True) and bool(value)
        ok = len(members) == fleet.size and all(w["ready"] for w in workers)
        checks["workers"] = ok
        body: dict[str, object] = {"ready": ok, "checks": checks, "workers": workers}
        if detail:
            body["release"] = detail
        return JSONResponse(body, status_code=200 if ok else 503)

    async def metrics(request: Request) -> Response:
        members = [m for m in fleet.members() if m.alive]
        answers = await asyncio.gather(
            *(ask(m.admin_socket, "/metrics") for m in members), return_exceptions=True
        )
        texts = {
            m.index: a[1].decode()
            for m, a in zip(members, answers, strict=True)
            if not isinstance(a, BaseException) and a[0] == 200
        }
        own = generate_latest(fleet.registry)
        return Response(fleet.totals.merge(texts) + own, media_type=CONTENT_TYPE_LATEST)

    routes = [Route("/healthz", healthz), Route("/readyz", readyz), Route("/metrics", metrics)]
    return Starlette(routes=routes)
