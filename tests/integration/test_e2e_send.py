"""The e2e harness's request through a real sidecar when the harness itself stalls.

Seen on real engines with the machine starved: P pinned a ``/v1/messages``
request, the harness opened its connection to the sidecar and was not
scheduled again for longer than the sidecar's ``client_header_timeout``; the
sidecar closed the silent connection quietly (as it must: see
``test_hostile_input``), and the harness's write met a closed connection,
"Server disconnected without sending a response". D never saw the request,
the sidecar logged nothing, and the whole run stopped there. Here the stall is
made on purpose between the harness client's connect and its write, against
the production server protocol.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpcore
import httpx
import pytest

from sidecar.sim.servers import ServerThread
from tests.e2e.evidence import Evidence
from tests.e2e.runner import Runner, Target
from tests.e2e.scenarios import CONTROL, decode_leg
from tests.e2e.verdict import Kind, judge, kinds_of
from tests.support.runner import Sidecar, guarded_sidecar, kv_params

HEADER_TIMEOUT = 0.5


class StallAfterConnect(httpcore.SyncBackend):
    """A network backend whose connections wait ``seconds`` between connecting and the first write."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def connect_tcp(self, *args: Any, **kwargs: Any) -> httpcore.NetworkStream:
        stream = super().connect_tcp(*args, **kwargs)
        time.sleep(self.seconds)
        return stream


class Stalling(httpx.BaseTransport):
    """httpx over ``StallAfterConnect``; httpcore's errors become httpx's, as httpx's own transport does."""

    def __init__(self, seconds: float) -> None:
        self.pool = httpcore.ConnectionPool(network_backend=StallAfterConnect(seconds))

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        core = httpcore.Request(
            request.method,
            httpcore.URL(
                scheme=b"http", host=request.url.raw_host, port=request.url.port, target=request.url.raw_path
            ),
            headers=request.headers.raw,
            content=request.read(),
        )
        try:
            answer = self.pool.handle_request(core)
            content = answer.read()
        except httpcore.RemoteProtocolError as exc:
            raise httpx.RemoteProtocolError(str(exc), request=request) from exc
        return httpx.Response(answer.status, headers=answer.headers, content=content, request=request)

    def close(self) -> None:
        self.pool.close()


@pytest.fixture
def sidecar(decode: ServerThread) -> Iterator[Sidecar]:
    with guarded_sidecar(decode.url, client_header_timeout=HEADER_TIMEOUT) as sc:
        yield sc


def send(sidecar: Sidecar, stall: float) -> Evidence:
    """The negative control's decode leg through ``sidecar`` by the harness's own ``send``, its
    client stalling ``stall`` seconds between connect and write."""
    target = Target("http://p.invalid", "http://d.invalid", "sim-model", 20.0, None)
    body = {"model": "sim-model", "prompt": "ka lo", "max_tokens": "abc"}
    content = decode_leg(body, kv_params("e2e-stalled"))
    ev = Evidence(lease=20.0)
    with httpx.Client(transport=Stalling(stall), timeout=10) as client:
        Runner(target, client).send(sidecar.url + CONTROL.route, content, CONTROL, ev)
    return ev


def test_a_harness_stalled_past_the_header_timeout_records_an_unsent_request(sidecar: Sidecar) -> None:
    ev = send(sidecar, HEADER_TIMEOUT * 4)  # the sidecar's timer fires long before the write
    assert ev.transport_error == "RemoteProtocolError: Server disconnected without sending a response."
    assert ev.status == 0 and ev.answered_by == "nobody"
    assert sidecar.wait_idle()
    # The sidecar never read it: no request counted, nothing released.
    assert sidecar.sample("kvr_requests_total", route="completions", status_class="4xx") == 0
    assert sidecar.released() == []
    ev.pinned, ev.expired = True, 1  # what P shows then: its lease freed the blocks
    assert kinds_of(judge(CONTROL.expect, CONTROL.expected_status(), ev)) == [Kind.UNSENT]


def test_the_same_request_without_the_stall_is_answered_and_released(sidecar: Sidecar) -> None:
    ev = send(sidecar, 0.0)
    assert ev.transport_error is None
    assert ev.status == 400 and ev.error_param == "body.max_tokens"
    assert sidecar.wait_released(1) == ["e2e-stalled"]
