"""The invariants every fault scenario (and every soak round) must keep, checked from ground truth.

``InvariantChecker(truth, view)`` is started with ``begin()`` before a scenario
sends anything and asked ``check(observed)`` after it. Ground truth is what the
simulators recorded, never what the sidecar says about itself: D's
``/sim/log`` (did D see, admit, reject or cancel each request), P's
``/sim/requests/{id}`` (notifications per rank, freed or pinned) and ``/stats``
(notifications for unknown ids, malformed ones, listener health). From D's log
and the client's answer ``derive_fate`` says who must free P's blocks:

* ``sidecar``: a definite rejection before admission (D refused it before its
  handler, D was unreachable, a 4xx error event opened a stream);
* ``d``: D admitted it (D reads and notifies P), or D's own fix (vLLM 0.21.0+)
  releases it (a rejection raised in D's handler, or the handler cancelled);
* ``none``: nobody may free it now (ambiguous: D may have admitted it, and the
  sidecar runs without ``--release-ambiguous``); P's lease will;
* ``unseen``: D never saw it and the client got no status (its connection
  broke): whether the sidecar forwarded it is unknowable from outside, and D
  cannot read blocks it never saw, so either decision is sound; P must agree
  with the one the sidecar made (freed once if released, untouched if not).

Invariants (each failure is listed, all at once, by ``Report.verify``):

1. No wrong release: no ``sent`` decision for a request D admitted, and no P
   rank notified twice for any request (a double release).
2. No lost release: a ``sidecar`` request is released exactly once and P frees
   it by notification, when P is reachable before the job's deadline
   (``reachable``); when it is not, the job fails (or is dropped, ``may_drop``)
   and P still holds the blocks. ``d`` requests are freed by D, ``none`` ones by
   nobody.
3. P unharmed: P received exactly the notifications the sidecar and D account
   for, none for an unknown id and none malformed; its side-channel listener is
   alive and a fresh ``DecodeClient`` handshake succeeds.
4. The sidecar is sound: no unhandled exception, its asyncio tasks back to the
   baseline, every release worker alive, every submitted job finished exactly
   once, no key or handshake left in flight, and its queue, ledger and
   handshake cache within the configured bounds (also at their sampled peaks,
   ``BoundsSampler``).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx

from sidecar.sim.dclient import DecodeClient
from tests.faults.evidence import SidecarView, total

Fate = Literal["sidecar", "d", "none", "unseen"]
PROGRESS_SIZE = 65536  # sidecar.release.nixl.PROGRESS_SIZE
POLL = 0.02


@dataclass
class Observed:
    """One request as the client saw it, and what the scenario expects of it."""

    request_id: str
    p_request_id: str
    status: int  # 0: no status reached the client
    sidecar_answered: bool  # the error body is the sidecar's own
    expected: Fate | None = None  # None: derived from ground truth alone
    reachable: bool = True  # P is reachable before the job's deadline
    may_drop: bool = False  # a full release queue may drop it (counted)
    note: str = ""  # what the client saw when no status came (its transport error)


class Truth:
    """Reads the simulators (P and D directly, never through a gate or the sidecar)."""

    def __init__(self, p_url: str, d_url: str, version: str) -> None:
        self.p_url, self.d_url, self.version = p_url, d_url, version
        # One client per thread (``p_records`` reads from 16 at once; a shared pool closing an
        # expired connection under another thread gave EBADF in a soak). Idle connections are
        # dropped after 1 s, before the simulators' 5 s keep-alive closes them (a reset on reuse).
        self._local = threading.local()
        self._clients: list[httpx.Client] = []
        self._lock = threading.Lock()

    @property
    def client(self) -> httpx.Client:
        client: httpx.Client | None = getattr(self._local, "client", None)
        if client is None:
            client = httpx.Client(timeout=10, limits=httpx.Limits(keepalive_expiry=1.0))
            self._local.client = client
            with self._lock:
                self._clients.append(client)
        return client

    def close(self) -> None:
        with self._lock:
            clients, self._clients = self._clients, []
        for client in clients:
            client.close()

    def _get(self, url: str) -> httpx.Response:
        """GET (idempotent: a read of the simulators' records), once more after a transport error."""
        try:
            return self.client.get(url)
        except httpx.TransportError:
            return self.client.get(url)

    def p_stats(self) -> dict[str, Any]:
        stats: dict[str, Any] = self._get(self.p_url + "/stats").json()
        return stats

    def p_record(self, p_request_id: str) -> dict[str, Any] | None:
        response = self._get(f"{self.p_url}/sim/requests/{p_request_id}")
        return response.json() if response.status_code == 200 else None

    def p_records(self, p_request_ids: Sequence[str]) -> dict[str, dict[str, Any] | None]:
        """``p_record`` for many ids, 16 at a time (a soak round checks thousands)."""
        if len(p_request_ids) < 8:
            return {rid: self.p_record(rid) for rid in p_request_ids}
        with ThreadPoolExecutor(16) as pool:
            return dict(zip(p_request_ids, pool.map(self.p_record, p_request_ids), strict=True))

    def d_log(self, ids: set[str]) -> dict[str, dict[str, Any]]:
        entries = self._get(self.d_url + "/sim/log").json()
        return {e["request_id"]: e for e in entries if e["request_id"] in ids}

    def fresh_handshake(self, stats: Mapping[str, Any]) -> str | None:
        """A brand-new D handshakes every P rank; None when it worked, else the error."""
        params = {
            "remote_host": stats["side_channel_host"],
            "remote_port": stats["side_channel_port"],
            "remote_engine_id": stats["engine_id"],
            "tp_size": stats["tp_size"],
            "pp_size": stats["pp_size"],
            "remote_registration_generation": stats["registration_generation"],
        }

        async def handshake() -> int:
            async with DecodeClient(self.version, timeout=5) as client:
                return len(await client.handshake(params, force=True))

        try:
            ranks = asyncio.run(handshake())
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
        expected = stats["tp_size"] * stats["pp_size"]
        return None if ranks == expected else f"handshake gave {ranks} agents, expected {expected}"


def derive_fate(obs: Observed, entry: Mapping[str, Any] | None, release_ambiguous: bool) -> Fate | None:
    """Who must free ``obs``'s blocks, from D's log entry and the client's answer (see module doc).

    None when the ground truth cannot tell (the client left before any status).
    """
    ambiguous: Fate = "sidecar" if release_ambiguous else "none"
    if entry is None:  # D never saw it
        if obs.sidecar_answered and obs.status in (503, 413):
            return "sidecar"  # unreachable, shutting down, body too large
        if obs.sidecar_answered and obs.status in (502, 504):
            return ambiguous  # sent, then reset or timed out: the sidecar cannot know D never saw it
        return None
    outcome = entry["outcome"]
    if entry["admitted"] or outcome == "cancelled":
        return "d"  # D reads; or D's own cleanup frees a cancelled handler (vLLM 0.21.0+)
    if outcome == "rejected":
        if entry["origin"] == "handler":
            return "d"  # D's own fix (vLLM 0.21.0+) releases its handler's rejections
        return "sidecar" if obs.status == entry["status"] else ambiguous  # D's verdict reached the sidecar
    if outcome == "stream_error":
        return "sidecar" if obs.status == 200 else ambiguous
    return None  # pending: D has not decided yet


@dataclass
class Report:
    """What ``check`` found; ``verify()`` raises with every violation."""

    violations: list[str] = field(default_factory=list)
    fates: dict[str, int] = field(default_factory=dict)
    decisions: dict[str, int] = field(default_factory=dict)
    p_delta: dict[str, int] = field(default_factory=dict)
    notifications: dict[str, float] = field(default_factory=dict)

    def fail(self, message: str) -> None:
        self.violations.append(message)

    def verify(self) -> Report:
        if self.violations:
            shown = "\n  ".join(self.violations[:40])
            more = f"\n  ... {len(self.violations) - 40} more" if len(self.violations) > 40 else ""
            raise AssertionError(f"{len(self.violations)} invariant violation(s):\n  {shown}{more}")
        return self


@dataclass
class BoundsSampler:
    """Samples the sidecar's gauges while a scenario runs; keeps their peaks."""

    view: SidecarView
    interval: float = 0.02
    peaks: dict[str, float] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)

    GAUGES = ("kvr_release_queue_depth", "kvr_release_ledger_size", "kvr_nixl_handshake_cache_engines")

    def sample(self) -> None:
        metrics = self.view.metrics()
        for name in self.GAUGES:
            self.peaks[name] = max(self.peaks.get(name, 0.0), metrics.get(name, 0.0))

    @contextmanager
    def running(self) -> Iterator[BoundsSampler]:
        thread = threading.Thread(target=self._run, name="bounds-sampler", daemon=True)
        thread.start()
        try:
            yield self
        finally:
            self._stop.set()
            thread.join(5)
            self.sample()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.sample()
            except httpx.HTTPError:
                continue  # the admin port is busy or going away; the next sample counts


class InvariantChecker:
    """Checks the invariants of the module docstring for one scenario or soak round."""

    def __init__(self, truth: Truth, view: SidecarView, ranks: int) -> None:
        self.truth, self.view, self.ranks = truth, view, ranks
        self._p0: dict[str, Any] = {}
        self._m0: dict[str, float] = {}
        self._tasks0: Counter[str] = Counter()

    def begin(self) -> None:
        """Take the baselines (P's counters, the sidecar's counters and tasks)."""
        self._p0 = self.truth.p_stats()
        self._m0 = self.view.metrics()
        self._tasks0 = Counter(self.view.tasks()[1])

    def check(
        self,
        observed: Sequence[Observed],
        *,
        timeout: float = 20.0,
        allow_unknown: int = 0,
        peaks: Mapping[str, float] | None = None,
    ) -> Report:
        """Wait (up to ``timeout``) for the sidecar and P to settle, then judge everything."""
        report = Report()
        deadline = time.monotonic() + timeout
        metrics = self._settle(report, deadline)
        entries = self.truth.d_log({o.request_id for o in observed})
        fates = self._fates(report, observed, entries)
        sent_ok = total(metrics, "kvr_nixl_notifications_total", result="ok") - total(
            self._m0, "kvr_nixl_notifications_total", result="ok"
        )
        expected = int(sent_ok) + self.ranks * sum(1 for fate in fates.values() if fate == "d")
        stats = self._wait_for_p(observed, fates, expected, deadline)
        by_p = self.truth.p_records([o.p_request_id for o in observed])
        records = {o.request_id: by_p[o.p_request_id] for o in observed}
        decisions = self.view.decisions()
        for obs in observed:
            self._judge(
                report,
                obs,
                fates.get(obs.request_id),
                entries.get(obs.request_id),
                records[obs.request_id],
                list(decisions.get(obs.request_id, ())),
            )
        self._p_unharmed(report, stats, expected, allow_unknown)
        self._sidecar_sound(report, metrics, peaks or {}, deadline)
        report.notifications = {"sidecar_sent": sent_ok, "expected_at_p": float(expected)}
        for fate in fates.values():
            report.fates[fate] = report.fates.get(fate, 0) + 1
        for obs in observed:
            for result in decisions.get(obs.request_id, ()):
                report.decisions[result] = report.decisions.get(result, 0) + 1
        return report

    # -- steps --------------------------------------------------------------------------------------

    def _settle(self, report: Report, deadline: float) -> dict[str, float]:
        """Every submitted job finished: sum(kvr_releases_total) == sum(kvr_rejections_total)."""
        while True:
            metrics = self.view.metrics()
            submitted = total(metrics, "kvr_rejections_total") - total(self._m0, "kvr_rejections_total")
            finished = total(metrics, "kvr_releases_total") - total(self._m0, "kvr_releases_total")
            if finished == submitted and metrics.get("kvr_release_queue_depth", 0.0) == 0:
                return metrics
            if time.monotonic() > deadline:
                report.fail(f"jobs not all finished: {submitted:.0f} submitted, {finished:.0f} finished")
                return metrics
            time.sleep(POLL)

    def _fates(
        self, report: Report, observed: Sequence[Observed], entries: Mapping[str, Mapping[str, Any]]
    ) -> dict[str, Fate]:
        fates: dict[str, Fate] = {}
        for obs in observed:
            derived = derive_fate(obs, entries.get(obs.request_id), self.view.bounds.release_ambiguous)
            if obs.expected is not None and derived is not None and derived != obs.expected:
                entry = entries.get(obs.request_id)
                report.fail(
                    f"{obs.request_id}: scenario expects {obs.expected!r} but ground truth says {derived!r} "
                    f"(client {obs.status}, D {entry and (entry['outcome'], entry['status'])})"
                )
            fate = derived or obs.expected
            if fate is None and obs.request_id not in entries and obs.status == 0:
                fate = "unseen"  # neither D nor the client saw an answer: see the module docstring
            if fate is None:
                report.fail(
                    f"{obs.request_id}: fate unknown "
                    f"(client {obs.status} {obs.note}, D {entries.get(obs.request_id)})"
                )
            else:
                fates[obs.request_id] = fate
        return fates

    def _wait_for_p(
        self, observed: Sequence[Observed], fates: Mapping[str, Fate], expected: int, deadline: float
    ) -> dict[str, Any]:
        """Until P received every notification accounted for and freed what it must (bounded)."""
        pending = [o for o in observed if fates.get(o.request_id) == "d" or _released(o, fates)]
        while True:
            stats = self.truth.p_stats()
            arrived = sum(stats["notifs_per_rank"]) - sum(self._p0["notifs_per_rank"])
            found = self.truth.p_records([o.p_request_id for o in pending])
            pending = [o for o in pending if not _freed(found[o.p_request_id])]
            if arrived >= expected and not pending:
                return stats
            if time.monotonic() > deadline:
                return stats
            time.sleep(POLL)

    def _judge(
        self,
        report: Report,
        obs: Observed,
        fate: Fate | None,
        entry: Mapping[str, Any] | None,
        record: Mapping[str, Any] | None,
        decisions: list[str],
    ) -> None:
        rid = obs.request_id
        if record is None:
            report.fail(f"{rid}: P has no record of {obs.p_request_id}")
            return
        counts: list[int] = record["notification_counts"]
        sent = decisions.count("sent")
        if entry is not None and entry["admitted"] and sent:
            report.fail(f"{rid}: WRONG RELEASE: the sidecar released a request D admitted ({decisions})")
        if any(count > 1 for count in counts):
            report.fail(f"{rid}: double release: P ranks notified {counts} ({decisions})")
        if fate == "sidecar" and obs.may_drop and decisions == ["dropped"]:
            _expect_pinned(report, rid, record, "dropped from the full queue")
        elif fate == "sidecar" and obs.reachable:
            if sent != 1 or any(d not in ("sent", "duplicate") for d in decisions):
                report.fail(f"{rid}: LOST RELEASE: definite rejection, decisions {decisions}")
            elif record["freed_by"] != "notification" or counts != [1] * self.ranks:
                report.fail(f"{rid}: LOST RELEASE: sent, but P shows {record['freed_by']} {counts}")
        elif fate == "sidecar":
            if not decisions or any(d not in ("failed", "dropped") for d in decisions):
                report.fail(f"{rid}: P unreachable past the deadline, yet decisions are {decisions}")
            _expect_pinned(report, rid, record, "P was unreachable")
        elif fate == "d":
            if sent:
                report.fail(f"{rid}: D frees it, yet the sidecar sent a release ({decisions})")
            if record["freed_by"] != "notification" or counts != [1] * self.ranks:
                report.fail(f"{rid}: D should have freed it: P shows {record['freed_by']} {counts}")
        elif fate == "none":
            if sent:
                report.fail(f"{rid}: ambiguous (D may have admitted it) but released ({decisions})")
            _expect_pinned(report, rid, record, "nobody may free it")
        elif fate == "unseen" and sent:
            if record["freed_by"] != "notification" or counts != [1] * self.ranks:
                report.fail(f"{rid}: released, but P shows {record['freed_by']} {counts} ({obs.note})")
        elif fate == "unseen":
            _expect_pinned(report, rid, record, f"not released ({decisions}; client: {obs.note})")

    def _p_unharmed(
        self, report: Report, stats: Mapping[str, Any], expected: int, allow_unknown: int
    ) -> None:
        p0 = self._p0
        delta = {k: int(stats[k] - p0[k]) for k in ("notifs_unknown", "notifs_malformed", "worker_errors")}
        delta["notifications"] = sum(stats["notifs_per_rank"]) - sum(p0["notifs_per_rank"])
        report.p_delta = delta
        if delta["notifications"] != expected:
            report.fail(
                f"P got {delta['notifications']} notifications; the sidecar and D account for {expected}"
            )
        if delta["notifs_unknown"] > allow_unknown:
            report.fail(
                f"P got {delta['notifs_unknown']} notification(s) for unknown ids (wrong/double release)"
            )
        if delta["notifs_malformed"] or delta["worker_errors"]:
            report.fail(f"P got malformed notifications or worker errors: {delta}")
        if not stats["listener_alive"] or any(stats["listener_errors"]):
            report.fail(f"P's side-channel listener died: {stats['listener_errors']}")
        else:
            problem = self.truth.fresh_handshake(stats)
            if problem:
                report.fail(f"a fresh D cannot handshake P any more: {problem}")

    def _sidecar_sound(
        self, report: Report, metrics: Mapping[str, float], peaks: Mapping[str, float], deadline: float
    ) -> None:
        for line in self.view.unhandled():
            report.fail(f"unhandled error in the sidecar: {line}")
        bounds = self.view.bounds
        limits = {
            "kvr_release_queue_depth": bounds.queue,
            "kvr_release_ledger_size": bounds.ledger,
            "kvr_nixl_handshake_cache_engines": bounds.engines,
        }
        for name, limit in limits.items():
            peak = max(metrics.get(name, 0.0), peaks.get(name, 0.0))
            if peak > limit:
                report.fail(f"{name} reached {peak:.0f}, over its bound {limit}")
        self._idle_internals(report, deadline)
        self._tasks_back(report, deadline)

    def _idle_internals(self, report: Report, deadline: float) -> None:
        while True:
            internals = self.view.internals()
            idle_zero = ("handshakes_in_flight", "inflight_live", "live_jobs", "targets")
            busy = {k: v for k, v in internals.items() if k in idle_zero and v}
            if not busy or time.monotonic() > deadline:
                break
            time.sleep(POLL)
        if busy:
            report.fail(f"left in flight after every request ended: {busy}")
        if internals.get("progress", 0) > PROGRESS_SIZE:
            report.fail(f"retry progress map over its bound: {internals['progress']}")

    def _tasks_back(self, report: Report, deadline: float) -> None:
        while True:
            # Compared by kind, not by total: a task that was running at the baseline and has
            # ended since must not hide one of another kind that was started and never ended.
            count, names = self.view.tasks()
            new = sorted((Counter(names) - self._tasks0).elements())
            if not new:
                return
            if time.monotonic() > deadline:
                report.fail(
                    f"task leak: {count} tasks on the sidecar's loop, {len(new)} new since the "
                    f"baseline: {new[:8]}"
                )
                return
            time.sleep(POLL)


def _released(obs: Observed, fates: Mapping[str, Fate]) -> bool:
    return fates.get(obs.request_id) == "sidecar" and obs.reachable and not obs.may_drop


def _freed(record: Mapping[str, Any] | None) -> bool:
    return record is not None and not record["pinned"]


def _expect_pinned(report: Report, rid: str, record: Mapping[str, Any], why: str) -> None:
    if not record["pinned"] or any(record["notification_counts"]):
        report.fail(f"{rid}: {why}, yet P shows {record['freed_by']} {record['notification_counts']}")
