"""SIGTERM with streams in flight and releases queued: ``python -m sidecar serve`` as a child process.

P is the shared simulator behind a ``FaultGate`` that first swallows every
handshake, so the rejections' releases are still being retried when the
signal arrives. D is a "vLLM D" whose streams take about 1.5 s. The child
logs JSON to a file; its release decisions and errors are read from there.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest

from sidecar.sim.decode import create_decode_app
from sidecar.sim.decode.config import DecodeSimConfig
from sidecar.sim.decode.nixl import VllmDHooks
from sidecar.sim.servers import ServerThread, serve
from tests.faults.cluster import MODEL, TP, VERSION, Backends, Flows, Sent
from tests.faults.evidence import parse_metrics, total
from tests.faults.gate import fault_gate
from tests.faults.invariants import Truth
from tests.faults.sidecar_proc import DELAY, DRAIN, FLUSH, Child, _status, child_sidecar
from tests.support.until import until

pytestmark = pytest.mark.nixl


@contextmanager
def long_streams() -> Iterator[ServerThread]:
    config = DecodeSimConfig(
        port=0,
        version=VERSION,
        model=MODEL,
        max_model_len=40,
        stream_events=30,
        event_delay=0.05,
        vllm_d=True,
    )
    with serve(create_decode_app(config, VllmDHooks(VERSION))) as d:
        yield d


def _start_streams(flows: Flows, url: str, count: int) -> tuple[list[threading.Thread], list[Sent]]:
    started = threading.Semaphore(0)
    done: list[Sent] = []

    def one() -> None:
        done.append(flows.decode(url, "stream", on_first_chunk=started.release))

    threads = [threading.Thread(target=one) for _ in range(count)]
    for thread in threads:
        thread.start()
    for _ in threads:
        assert started.acquire(timeout=10)
    return threads, done


def _shutdown_scenario(cluster: Backends, heal: bool) -> None:
    with long_streams() as d, fault_gate(cluster.side_channel_port) as gate, child_sidecar(d.url) as child:
        truth = Truth(cluster.p.url, d.url, VERSION)
        flows = Flows(cluster, "sigterm")
        p0 = truth.p_stats()
        try:
            gate.set("blackhole")
            rejected = [flows.decode(child.url, "reject", gate=gate) for _ in range(3)]
            until(lambda: _metric(child, "kvr_nixl_errors_total", reason="handshake_timeout") >= 3, "retries")
            threads, streams = _start_streams(flows, child.url, 2)
            began = time.monotonic()
            child.proc.send_signal(signal.SIGTERM)
            until(lambda: _status(child.admin + "/readyz") == 503, "readiness off")
            for thread in threads:
                thread.join(DRAIN)
            if heal:
                gate.set("pass")  # P answers again while the sidecar flushes
            code = child.proc.wait(DRAIN + FLUSH + 10)
            elapsed = time.monotonic() - began
            _verdict(child, truth, p0, rejected, streams, heal, code, elapsed)
        finally:
            flows.close()
            truth.close()


def _verdict(
    child: Child,
    truth: Truth,
    p0: dict[str, object],
    rejected: list[Sent],
    streams: list[Sent],
    heal: bool,
    code: int,
    elapsed: float,
) -> None:
    assert code == 0
    assert elapsed < DELAY + 1.5 + FLUSH + 2.0, elapsed  # the streams' rest, the flush bound, start-up slack
    assert [(x.status, x.broken, x.body.rstrip().endswith(b"data: [DONE]")) for x in streams] == [
        (200, False, True)
    ] * 2
    assert [x.status for x in rejected] == [400] * 3
    view = child.view()
    decisions = view.decisions()
    assert view.unhandled() == []
    for sent in streams:  # D admitted them and freed P's blocks itself; nothing released
        record = truth.p_record(sent.p_request_id)
        assert record is not None and (record["notification_counts"], decisions.get(sent.request_id)) == (
            [1] * TP,
            None,
        )
    for sent in rejected:
        record = truth.p_record(sent.p_request_id)
        assert record is not None
        if heal:  # flushed: released once, freed by notification
            assert (decisions.get(sent.request_id), record["notification_counts"]) == (["sent"], [1] * TP)
        else:  # flush bound passed: accounted as dropped, P keeps the blocks (its lease)
            assert (decisions.get(sent.request_id), record["pinned"]) == (["dropped"], True)
    stats = truth.p_stats()
    assert (stats["notifs_unknown"], stats["notifs_malformed"]) == (
        p0["notifs_unknown"],
        p0["notifs_malformed"],
    )
    assert stats["listener_alive"] and truth.fresh_handshake(stats) is None
    assert _stopped(child) == {"releases_flushed": heal}


def _metric(child: Child, name: str, **labels: str) -> float:
    return total(parse_metrics(httpx.get(child.admin + "/metrics", timeout=5).text), name, **labels)


def _stopped(child: Child) -> dict[str, object]:
    for line in child.log.read_bytes().splitlines():
        if b'"sidecar stopped"' in line:
            return {"releases_flushed": json.loads(line)["releases_flushed"]}
    return {}


def test_sigterm_drains_streams_and_flushes_releases(cluster: Backends) -> None:
    """SIGTERM with two streams in flight and three releases retrying against a silent P.

    Expected: ``/readyz`` turns 503; both streams complete (200, ``[DONE]``);
    P answers again after the streams ended and the queued releases are
    flushed: each released once, freed by notification; the log says
    ``releases_flushed: true``; exit code 0 within the drain and flush bounds;
    no unhandled error; P unharmed.
    """
    _shutdown_scenario(cluster, heal=True)


def test_sigterm_with_p_still_silent_gives_up_at_the_flush_bound(cluster: Backends) -> None:
    """SIGTERM while P stays silent: the flush gives up after ``flush_timeout``.

    Expected: the streams complete; exit code 0 within the bounds; the log says
    ``releases_flushed: false``; every rejection is still accounted for (a
    ``dropped`` release decision each) and P keeps those blocks.
    """
    _shutdown_scenario(cluster, heal=False)
