"""Faults on the decode side: D down, going down, flapping, slow, resetting, answering garbage.

The sidecar sits in front of a ``FaultGate`` in front of "vLLM D"; P is
reachable. Every scenario ends with the full invariant check
(``tests/faults/invariants.py``): no wrong release, no lost release, P
unharmed, no unhandled exception, no task leak, bounds kept.
"""

from __future__ import annotations

import socket
import struct
import threading
from asyncio import StreamReader, StreamWriter
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.faults.cluster import MODEL, Backends, Kind, scene
from tests.faults.gate import fault_gate
from tests.faults.invariants import Observed

pytestmark = pytest.mark.nixl


def _error_type(body: bytes) -> str:
    return str(httpx.Response(200, content=body).json()["error"]["type"])


def test_d_down_at_start(cluster: Backends) -> None:
    """D refuses connections from the start, then comes up.

    Expected: every P/D request while D is down gets the sidecar's own 503
    (ServiceUnavailableError) and is released at once (cause ``unreachable``,
    one ``sent`` per request, P frees it by notification); ``/readyz`` is 503.
    Once D is up, an admitted request gets 200 and is freed by D; the sidecar
    sends nothing for it.
    """
    with fault_gate(cluster.d.port) as gate:
        gate.set("down")
        with scene(cluster, gate.url, "down-start") as s:
            assert httpx.get(s.sc.admin_url + "/readyz").status_code == 503
            down = [s.flows.decode(s.sc.url, kind) for kind in ("admit", "reject", "stream")]
            assert [(x.status, _error_type(x.body)) for x in down] == [(503, "ServiceUnavailableError")] * 3
            gate.set("pass")
            up = s.flows.decode(s.sc.url, "admit")
            assert up.status == 200
            s.check([*(s.observe(x, "sidecar") for x in down), s.observe(up, "d")])
            assert s.sample("kvr_rejections_total", cause="unreachable") == 3
            assert s.sample("kvr_releases_total", strategy="nixl", result="sent") == 3
            assert gate.stats["accepted_pass"] >= 1


def test_d_goes_down_mid_run(cluster: Backends) -> None:
    """D serves, goes down while a stream is in flight, and comes back.

    Expected: before, 200 (D frees). The stream in flight is cut: the client
    sees 200 then a broken body, D had admitted it (D frees), the sidecar sends
    nothing and aborts the client's connection on purpose. While D is down:
    503 from the sidecar, released once each. After: 200 again.
    """
    with fault_gate(cluster.d.port) as gate, scene(cluster, gate.url, "down-mid") as s:
        before = s.flows.decode(s.sc.url, "admit")
        cut = s.flows.decode(s.sc.url, "stream", on_first_chunk=lambda: gate.set("down"))
        during = [s.flows.decode(s.sc.url, kind) for kind in ("admit", "reject")]
        gate.set("pass")
        after = s.flows.decode(s.sc.url, "admit")
        assert (before.status, cut.status, cut.broken, after.status) == (200, 200, True, 200)
        assert [x.status for x in during] == [503, 503]
        s.check(
            [
                s.observe(before, "d"),
                s.observe(cut, "d"),
                *(s.observe(x, "sidecar") for x in during),
                s.observe(after, "d"),
            ]
        )
        assert s.watch.aborted_streams == 1
        assert s.sample("kvr_releases_total", strategy="nixl", result="sent") == 2


def test_d_flapping(cluster: Backends) -> None:
    """D goes down and up every few requests, and also while requests race the switch.

    Expected: each request's fate follows what happened to it (D's log and the
    client's answer): refused -> 503 and released once; reached D -> D's answer
    (freed by D, or released by the sidecar for a pre-handler rejection, also
    when the switch cut D's error body: its status decides); cut on the way
    (502) -> not released. The invariants hold whatever the timing.
    """
    kinds: list[Kind] = ["admit", "reject", "stream", "reject_handler"]
    with fault_gate(cluster.d.port) as gate, scene(cluster, gate.url, "flap") as s:
        for step in range(16):  # deterministic flapping between requests
            gate.set("down" if step % 4 in (1, 2) else "pass")
            s.flows.decode(s.sc.url, kinds[step % len(kinds)])
        stop = threading.Event()

        def flap() -> None:
            while not stop.is_set():
                gate.set("down")
                stop.wait(0.01)
                gate.set("pass")
                stop.wait(0.02)

        flapper = threading.Thread(target=flap)
        flapper.start()
        # No handler rejection races the switch: one whose error body is cut has no error type left,
        # so D's own release of it cannot be recognised and the sidecar releases it too, by design
        # (sidecar.decision.coverage prefers a double release to a lost one).
        racing: list[Kind] = ["admit", "reject", "stream"]
        try:
            with ThreadPoolExecutor(4) as pool:
                list(pool.map(lambda i: s.flows.decode(s.sc.url, racing[i % 3]), range(24)))
        finally:
            stop.set()
            flapper.join()
        gate.set("pass")
        statuses = {x.status for x in s.flows.sent}
        assert 503 in statuses and 200 in statuses and 400 in statuses, statuses
        report = s.check([s.observe(x) for x in s.flows.sent])
        assert report.fates.get("sidecar", 0) >= 4  # refused ones (and pre-handler rejections)
        assert gate.stats["switch_down"] >= 8


def test_d_slow_to_send_headers(cluster: Backends) -> None:
    """D takes longer than ``header_timeout`` to answer one request, less for another.

    Expected: the slow one gets 504 (GatewayTimeoutError), is ambiguous (D may
    have admitted it) and not released by the sidecar; the sidecar's abort
    reaches D's handler, whose own cleanup (vLLM 0.21.0+) frees P's blocks.
    The quicker one gets 200 and is freed by D. Metrics:
    ``kvr_not_released_total{outcome="ambiguous",cause="header_timeout"}`` 1.
    """
    with scene(cluster, cluster.d.url, "slow", header_timeout=0.5) as s:
        slow = s.flows.decode(s.sc.url, "slow", slow=3.0)
        quick = s.flows.decode(s.sc.url, "slow", slow=0.1)
        assert (slow.status, _error_type(slow.body)) == (504, "GatewayTimeoutError")
        assert quick.status == 200
        s.check([s.observe(slow, "d"), s.observe(quick, "d")])
        assert s.sample("kvr_not_released_total", outcome="ambiguous", cause="header_timeout") == 1
        assert s.sample("kvr_releases_total", strategy="nixl", result="sent") == 0


def test_release_ambiguous_header_timeout_is_released_once(cluster: Backends) -> None:
    """With ``--release-ambiguous``, D slow past ``header_timeout`` (in its handler).

    Expected: 504; P's blocks freed exactly once per rank (by D's cleanup or
    by the sidecar, not both); no notification for an unknown id.
    """
    with scene(cluster, cluster.d.url, "slow-amb", header_timeout=0.5, release_ambiguous=True) as s:
        slow = s.flows.decode(s.sc.url, "slow", slow=3.0)
        assert slow.status == 504
        s.check([s.observe(slow)])


def test_router_mode_header_timeout_is_released_once(cluster: Backends) -> None:
    """Router mode (``--prefill``): the sidecar runs the prefill leg on P; D is slow past ``header_timeout``.

    Expected: 504; D's log shows the handler cancelled; P's blocks freed
    exactly once per rank (by D's cleanup or by the sidecar, not both); no
    notification for an unknown id.
    """
    with scene(cluster, cluster.d.url, "router-slow", prefill=(cluster.p.url,), header_timeout=0.5) as s:
        request_id = s.flows.next_id()
        body = {"model": MODEL, "prompt": "tok tok [[slow-headers:3.0]]", "max_tokens": 4}
        response = s.flows.client.post(
            s.sc.url + "/v1/completions", json=body, headers={"x-request-id": request_id}
        )
        assert response.status_code == 504
        # D logged the decode leg on arrival, with the parameters P answered the router.
        entry = s.checker.truth.d_log({request_id})[request_id]
        p_request_id = entry["kv_transfer_params"]["remote_request_id"]
        s.check([Observed(request_id, p_request_id, 504, sidecar_answered=True, expected="d")])


def test_d_resets_mid_stream(cluster: Backends) -> None:
    """D admits a stream and cuts it after two events; D admits a plain request and the link
    resets before headers.

    Expected: the cut stream: 200 then a broken body (the sidecar aborts the
    client's connection on purpose), D admitted it and frees it, nothing
    released. The reset before headers: 502 (BadGatewayError), D never saw it,
    ambiguous, not released: P keeps the blocks for its lease;
    ``kvr_not_released_total{cause="reset_after_send"}`` 1.
    """
    with fault_gate(cluster.d.port) as gate, scene(cluster, gate.url, "reset") as s:
        cut = s.flows.decode(s.sc.url, "drop")
        gate.set("reset")
        reset = s.flows.decode(s.sc.url, "admit")
        gate.set("pass")
        assert (cut.status, cut.broken) == (200, True)
        assert (reset.status, _error_type(reset.body)) == (502, "BadGatewayError")
        s.check([s.observe(cut, "d"), s.observe(reset, "none")])
        assert s.watch.aborted_streams == 1
        assert s.sample("kvr_not_released_total", outcome="ambiguous", cause="reset_after_send") == 1


def test_d_reset_before_headers_with_release_ambiguous(cluster: Backends) -> None:
    """The link resets before D's headers, with ``--release-ambiguous``.

    Expected: 502; D never saw the request and the sidecar releases it (cause
    ``reset_after_send``), once; P frees it by notification.
    """
    with (
        fault_gate(cluster.d.port) as gate,
        scene(cluster, gate.url, "reset-amb", release_ambiguous=True) as s,
    ):
        gate.set("reset")
        reset = s.flows.decode(s.sc.url, "reject")
        assert reset.status == 502
        s.check([s.observe(reset, "sidecar")])
        assert s.sample("kvr_rejections_total", cause="reset_after_send") == 1


async def _error_head_then_reset(reader: StreamReader, writer: StreamWriter) -> None:
    await reader.read(65536)
    writer.write(b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\ncontent-length: 99\r\n\r\n{")
    await writer.drain()
    writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


def test_d_rejects_then_resets_mid_error_body(cluster: Backends) -> None:
    """D sends ``400`` headers, then resets before the error body is complete.

    Expected: D's 400 status is a definite rejection: the client gets a 4xx/5xx
    vLLM-shaped error, the request is released once, no unhandled exception.
    """
    with fault_gate(cluster.d.port) as gate, scene(cluster, gate.url, "err-reset") as s:
        gate.set("script", script=_error_head_then_reset)
        broken = s.flows.decode(s.sc.url, "reject")
        s.check([s.observe(broken, "sidecar")])
        assert (broken.status, _error_type(broken.body)) == (400, "BadRequestError")  # D's status, our body
        assert s.sample("kvr_rejections_total", cause="rejected_4xx") == 1


def test_d_answers_garbage(cluster: Backends) -> None:
    """A raw socket server answers non-HTTP bytes instead of D, then D is back.

    Expected: 502 (BadGatewayError) for each request; the request was written,
    so it is ambiguous and not released (P keeps the blocks for its lease);
    the sidecar survives and serves the next request once D answers again.
    """
    with fault_gate(cluster.d.port) as gate, scene(cluster, gate.url, "garbage") as s:
        gate.set("garbage")
        garbled = [s.flows.decode(s.sc.url, kind) for kind in ("reject", "stream")]
        gate.set("pass")
        ok = s.flows.decode(s.sc.url, "admit")
        assert [(x.status, _error_type(x.body)) for x in garbled] == [(502, "BadGatewayError")] * 2
        assert ok.status == 200
        s.check([*(s.observe(x, "none") for x in garbled), s.observe(ok, "d")])
        assert gate.stats["accepted_garbage"] >= 2
