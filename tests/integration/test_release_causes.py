"""Each release cause gives exactly one release job; each no-release outcome gives none.

Real uvicorn servers on loopback: the fake vLLM decode server (``sim-decode``)
behind the sidecar, whose ``dry-run`` releaser records every job it gets.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

from sidecar.config import Config
from sidecar.sim.decode import create_decode_app
from sidecar.sim.decode.config import DecodeSimConfig
from sidecar.sim.servers import ServerThread, serve
from tests.support.ports import free_port
from tests.support.runner import RETRIED, SHIPPED, Sidecar, run_sidecar
from tests.support.runner import kv_params as params
from tests.support.until import until_async

DECODE = DecodeSimConfig(
    port=0, max_model_len=50, stream_events=4, log_params=True
)  # D for this module (the ``decode`` fixture)


def chat(text: str, rid: str, stream: object = False, **extra: Any) -> dict[str, Any]:
    return {
        "model": "sim-model",
        "messages": [{"role": "user", "content": text}],
        "max_tokens": 4,
        "stream": stream,
        "kv_transfer_params": params(rid),
        **extra,
    }


@pytest.fixture
def sidecar(decode: ServerThread) -> Iterator[Sidecar]:
    with run_sidecar(decode.url) as sc:
        yield sc


RELEASES = [
    ("prompt too long (400)", chat("word " * 80, "r-long"), 400, "rejected_4xx"),
    ("unknown model (404)", {**chat("hi", "r-model"), "model": "nope"}, 404, "rejected_4xx"),
    (
        "validation (400, before handler)",
        {"model": "sim-model", "kv_transfer_params": params("r-val")},
        400,
        "rejected_4xx",
    ),
    ("not implemented (501)", chat("hi [[reject:501]]", "r-501"), 501, "rejected_5xx"),
    ("stream: non-200 before SSE", chat("word " * 80, "r-long-s", stream=True), 400, "rejected_4xx"),
    (
        "stream admission failure",
        chat("hi [[stream-error:400]]", "r-sse", stream=True),
        200,
        "stream_admission_error",
    ),
    (
        # vLLM's pydantic reads "yes" (or 1, "true", "on") as a bool: D streams, and its
        # content type tells the sidecar to judge the first event.
        "stream admission failure, lax stream flag",
        chat("hi [[stream-error:400]]", "r-sse-lax", stream="yes"),
        200,
        "stream_admission_error",
    ),
]


@pytest.mark.parametrize(("name", "body", "status", "cause"), RELEASES, ids=[r[0] for r in RELEASES])
def test_release_causes_give_one_job(
    sidecar: Sidecar, name: str, body: dict[str, Any], status: int, cause: str
) -> None:
    response = httpx.post(sidecar.url + "/v1/chat/completions", json=body, timeout=10)
    assert response.status_code == status
    sidecar.settle()
    jobs = list(sidecar.releaser.recorded)
    assert [j.params.remote_request_id for j in jobs] == [body["kv_transfer_params"]["remote_request_id"]]
    assert jobs[0].cause == cause
    assert sidecar.sample("kvr_rejections_total", cause=cause) == 1
    assert sidecar.sample("kvr_releases_total", strategy="dry-run", result="dry_run") == 1


NO_RELEASES = [
    ("admitted", chat("hello", "n-ok"), 200),
    ("admitted stream", chat("hello", "n-ok-s", stream=True), 200),
    ("5xx error event in stream", chat("hi [[stream-error:500]]", "n-sse5", stream=True), 200),
    (
        "push mode",
        {**chat("word " * 80, "n-push"), "kv_transfer_params": params("n-push", transfer_mode="push")},
        400,
    ),
    (
        "empty blocks",
        {**chat("word " * 80, "n-empty"), "kv_transfer_params": params("n-empty", remote_block_ids=[[]])},
        400,
    ),
    (
        "malformed",
        {**chat("word " * 80, "n-bad"), "kv_transfer_params": params("n-bad", remote_port="x")},
        400,
    ),
    ("not P/D", {**chat("word " * 80, "n-none"), "kv_transfer_params": None}, 400),
    (
        "do_remote_prefill false",
        {**chat("word " * 80, "n-f"), "kv_transfer_params": params("n-f", do_remote_prefill=False)},
        400,
    ),
]


@pytest.mark.parametrize(("name", "body", "status"), NO_RELEASES, ids=[r[0] for r in NO_RELEASES])
def test_no_release_outcomes_give_no_job(
    sidecar: Sidecar, name: str, body: dict[str, Any], status: int
) -> None:
    response = httpx.post(sidecar.url + "/v1/chat/completions", json=body, timeout=10)
    assert response.status_code == status
    response.read()
    sidecar.settle()
    assert sidecar.released() == []


def left_to_a_retry(sc: Sidecar, cause: str) -> None:
    """Under the shipped ``retried_statuses`` (502, 503, 504) nothing is released behind a status a
    proxy in front may resend to another pod, where that pod's D reads P's blocks."""
    sc.settle()
    assert sc.app.config.retried_statuses == Config().retried_statuses  # the default, as shipped
    assert sc.released() == []
    assert sc.sample("kvr_not_released_total", outcome="retryable", cause=cause) == 1


@RETRIED
def test_ds_503_is_left_to_a_retry_under_the_default_and_released_under_none(
    decode: ServerThread, retried: object
) -> None:
    body = chat("hi [[reject:503]]", "r-503")
    direct = httpx.post(decode.url + "/v1/chat/completions", json=body, timeout=10)
    with run_sidecar(decode.url, retried_statuses=retried) as sc:
        response = httpx.post(sc.url + "/v1/chat/completions", json=body, timeout=10)
        assert (response.status_code, response.json()) == (503, direct.json())  # D's answer, as it is
        if retried == SHIPPED:
            left_to_a_retry(sc, "rejected_5xx")
        else:
            assert sc.wait_released(1) == ["r-503"]
            assert sc.releaser.recorded[0].cause == "rejected_5xx"


def test_malformed_params_are_counted_and_still_forwarded(sidecar: Sidecar, decode: ServerThread) -> None:
    body = {**chat("hello", "m-1"), "kv_transfer_params": params("m-1", tp_size="two")}
    response = httpx.post(sidecar.url + "/v1/chat/completions", json=body, headers={"x-request-id": "mal-1"})
    assert response.status_code == 200
    assert sidecar.sample("kvr_ineligible_total", reason="malformed") == 1
    log = httpx.get(decode.url + "/sim/log").json()
    assert any(entry["request_id"] == "mal-1" for entry in log)


def test_non_json_body_forwarded_and_answered_by_d(sidecar: Sidecar) -> None:
    response = httpx.post(
        sidecar.url + "/v1/completions", content=b"not json", headers={"content-type": "application/json"}
    )
    assert response.status_code == 400
    assert response.json()["error"]["code"] == 400
    sidecar.settle()
    assert sidecar.released() == []


@RETRIED
def test_d_down_answers_503_and_releases_unless_a_proxy_may_retry_it(retried: object) -> None:
    with run_sidecar(f"http://127.0.0.1:{free_port()}", retried_statuses=retried) as sc:
        response = httpx.post(
            sc.url + "/v1/completions", json={"prompt": "x", "kv_transfer_params": params("down-1")}
        )
        assert response.status_code == 503
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["code"] == 503
        if retried == SHIPPED:
            left_to_a_retry(sc, "unreachable")
            return
        assert sc.wait_released(1) == ["down-1"]
        assert sc.releaser.recorded[0].cause == "unreachable"


def test_body_over_cap_answers_413_and_releases(decode: ServerThread) -> None:
    with run_sidecar(decode.url, max_body_bytes=2048) as sc:
        body = {"model": "sim-model", "prompt": "x " * 4000, "kv_transfer_params": params("big-1")}
        response = httpx.post(sc.url + "/v1/completions", json=body)
        assert response.status_code == 413
        assert response.json()["error"]["type"] == "RequestEntityTooLargeError"
        assert sc.wait_released(1) == ["big-1"]
        assert sc.releaser.recorded[0].cause == "body_too_large"
        log = httpx.get(decode.url + "/sim/log").json()
        assert not any((e.get("kv_transfer_params") or {}).get("remote_request_id") == "big-1" for e in log)


@RETRIED
def test_shutting_down_refuses_and_releases_unless_a_proxy_may_retry_it(
    decode: ServerThread, retried: object
) -> None:
    with run_sidecar(decode.url, retried_statuses=retried) as sc:
        assert sc.app.runtime is not None
        sc.app.runtime.proxy.stopping = True
        response = httpx.post(sc.url + "/v1/chat/completions", json=chat("hi", "stop-1"))
        assert response.status_code == 503
        if retried == SHIPPED:
            left_to_a_retry(sc, "shutting_down")
            return
        assert sc.wait_released(1) == ["stop-1"]
        assert sc.releaser.recorded[0].cause == "shutting_down"


def test_header_timeout_is_504_and_ambiguous(decode: ServerThread) -> None:
    with run_sidecar(decode.url, header_timeout=0.3) as sc:
        response = httpx.post(sc.url + "/v1/chat/completions", json=chat("hi [[slow-headers:2]]", "slow-1"))
        assert response.status_code == 504
        sc.settle()
        assert sc.released() == []
        assert sc.sample("kvr_not_released_total", outcome="ambiguous", cause="header_timeout") == 1


@RETRIED
def test_header_timeout_is_released_when_configured_unless_a_proxy_may_retry_it(
    decode: ServerThread, retried: object
) -> None:
    with run_sidecar(decode.url, header_timeout=0.3, release_ambiguous=True, retried_statuses=retried) as sc:
        response = httpx.post(sc.url + "/v1/chat/completions", json=chat("hi [[slow-headers:2]]", "slow-2"))
        assert response.status_code == 504
        if retried == SHIPPED:
            left_to_a_retry(sc, "header_timeout")
            return
        assert sc.wait_released(1) == ["slow-2"]


def test_client_disconnect_mid_stream_closes_upstream_and_releases_nothing() -> None:
    aborted = threading.Event()

    async def endless(request: Request) -> StreamingResponse:
        async def events() -> AsyncIterator[bytes]:
            try:
                while True:
                    yield b'data: {"choices": [{"delta": {"content": "t"}}]}\n\n'
                    await asyncio.sleep(0.01)
            finally:  # cancelled when the connection to D is closed
                aborted.set()

        return StreamingResponse(events(), media_type="text/event-stream")

    d = Starlette(routes=[Route("/v1/chat/completions", endless, methods=["POST"])])
    with serve(d) as slow_d, run_sidecar(slow_d.url) as sc:
        body = chat("hello", "gone-1", stream=True)
        with httpx.stream("POST", sc.url + "/v1/chat/completions", json=body, timeout=10) as response:
            assert response.status_code == 200
            next(response.iter_raw())
        assert aborted.wait(5), "D never saw the client's abort"
        sc.settle()
        assert sc.released() == []
        assert sc.sample("kvr_not_released_total", outcome="no_release", cause="admitted") == 1


def test_client_gone_before_forward_releases() -> None:
    """A request waiting for a pooled connection to D is not forwarded yet."""
    gate = threading.Event()
    hold = socket.socket()
    hold.bind(("127.0.0.1", 0))
    hold.listen(16)
    port = hold.getsockname()[1]

    conns: list[socket.socket] = []  # requests that reached D
    held: list[socket.socket] = []  # every connection D accepted, held open

    def accept_and_hang() -> None:
        while not gate.is_set():
            hold.settimeout(0.05)
            try:
                conn = hold.accept()[0]
            except OSError:
                continue
            conn.settimeout(5)
            held.append(conn)
            start = b""
            while len(start) < 5 and (chunk := conn.recv(5 - len(start))):
                start += chunk
            if start == b"POST ":  # not the sidecar's own poll of D's /health or /metrics
                conns.append(conn)  # busy-1 reached D (D may read it): it must not be released
        for conn in held:
            conn.close()

    thread = threading.Thread(target=accept_and_hang, daemon=True)
    thread.start()
    try:
        with run_sidecar(f"http://127.0.0.1:{port}", pool_size=1, pool_timeout=30) as sc:

            async def scenario() -> None:
                async with httpx.AsyncClient(timeout=10) as client:
                    first = asyncio.create_task(
                        client.post(
                            sc.url + "/v1/completions",
                            json={"prompt": "a", "kv_transfer_params": params("busy-1")},
                        )
                    )
                    # the only pooled connection is now taken by busy-1
                    await until_async(lambda: len(conns) == 1)
                    second = asyncio.create_task(
                        client.post(
                            sc.url + "/v1/completions",
                            json={"prompt": "b", "kv_transfer_params": params("wait-1")},
                        )
                    )
                    await until_async(lambda: sc.sample("kvr_inflight_requests") == 2)
                    second.cancel()  # the client leaves while its request waits for a connection
                    first.cancel()
                    await asyncio.gather(first, second, return_exceptions=True)

            asyncio.run(scenario())
            released = sc.wait_released(1)
            assert released == ["wait-1"]
            assert sc.releaser.recorded[0].cause == "client_gone_before_forward"
            assert sc.wait_idle()  # busy-1's handler may notice its client left after wait-1's did
            assert (
                sc.sample("kvr_not_released_total", outcome="ambiguous", cause="client_gone_after_forward")
                == 1
            )
    finally:
        gate.set()
        thread.join(2)
        hold.close()


@pytest.mark.serial  # a thousand connections at once load the machine (make test runs it alone)
def test_thousand_concurrent_requests_release_exactly_the_rejected_once(decode: ServerThread) -> None:
    rejected = {f"c-{i}" for i in range(0, 1000, 10)}

    async def scenario() -> list[int]:
        limits = httpx.Limits(max_connections=1000, max_keepalive_connections=1000)
        async with httpx.AsyncClient(timeout=60, limits=limits) as client:

            async def one(i: int) -> int:
                rid = f"c-{i}"
                text = "word " * 80 if rid in rejected else "hello"
                response = await client.post(sc.url + "/v1/chat/completions", json=chat(text, rid))
                return response.status_code

            return await asyncio.gather(*(one(i) for i in range(1000)))

    with run_sidecar(decode.url) as sc:
        statuses = asyncio.run(scenario())
        assert statuses.count(400) == 100 and statuses.count(200) == 900
        sc.settle()
        released = sc.released()
        assert sorted(released) == sorted(rejected)
        assert len(released) == len(set(released))
        # a client retrying the same rejected requests releases nothing more (dry-run frees
        # nothing, so the retries still go to D: only counted)
        for rid in sorted(rejected)[:5]:
            retry = httpx.post(sc.url + "/v1/chat/completions", json=chat("word " * 80, rid))
            assert retry.status_code == 400  # D's answer
        sc.settle()
        assert len(sc.released()) == 100
        assert sc.sample("kvr_releases_total", strategy="dry-run", result="duplicate") == 5
        assert sc.sample("kvr_released_replays_total", action="forwarded") == 5


def test_job_carries_the_body_request_id(sidecar: Sidecar) -> None:
    body = {"model": "nope", "input": "hi", "request_id": "resp_client-7"}
    body["kv_transfer_params"] = params("b-1")
    response = httpx.post(sidecar.url + "/v1/responses", json=body)
    assert response.status_code == 404
    sidecar.settle()
    [job] = sidecar.releaser.recorded
    assert (job.route, job.body_request_id) == ("/v1/responses", "resp_client-7")


@pytest.mark.parametrize("strategy", ["http", "auto", "nixl"])
def test_the_job_carries_the_params_as_sent_and_the_dp_rank(decode: ServerThread, strategy: str) -> None:
    """The http strategy hands D's engine P's parameters verbatim (also fields a newer vLLM
    appends) and the request's DP rank; the job carries both (the raw bytes only for the
    strategies that use them)."""
    # A release without D's own fix (0.20.2): the prompt-too-long 400 is the sidecar's to release.
    settings = {"release": strategy, "control_token": "t", "vllm_version": "0.20.2"}
    with run_sidecar(decode.url, record=True, **settings) as sidecar:
        _post_with_rank(sidecar, strategy)


def _post_with_rank(sidecar: Sidecar, strategy: str) -> None:
    body = chat("word " * 80, "r-raw")
    body["kv_transfer_params"]["a_newer_field"] = {"nested": [1, 2]}
    content = json.dumps(body, separators=(",", ":")).encode()
    response = httpx.post(
        sidecar.url + "/v1/chat/completions",
        content=content,
        headers={"content-type": "application/json", "x-data-parallel-rank": "2"},
    )
    assert response.status_code == 400
    assert sidecar.wait_released(1) == ["r-raw"]
    job = sidecar.releaser.recorded[0]
    if strategy == "nixl":
        assert job.raw_params is None  # the NIXL strategy never hands them on: not kept
    else:
        assert job.raw_params is not None
        assert json.loads(job.raw_params) == body["kv_transfer_params"]
    assert job.data_parallel_rank == 2


def responses_body(text: str, rid: str) -> dict[str, Any]:
    return {"model": "sim-model", "input": text, "stream": True, "kv_transfer_params": params(rid)}


def test_responses_stream_is_judged_after_its_lead_events(sidecar: Sidecar) -> None:
    # vLLM sends response.created and response.in_progress before its engine has the request:
    # they do not show an admission; the next event does.
    with httpx.stream("POST", sidecar.url + "/v1/responses", json=responses_body("hello", "rs-ok")) as r:
        assert r.status_code == 200
        events = [line for line in r.iter_lines() if line.startswith("event:")]
    assert events[:3] == ["event: response.created", "event: response.in_progress", events[2]]
    assert events[2] not in ("event: response.created", "event: response.in_progress")
    sidecar.settle()
    assert sidecar.sample("kvr_not_released_total", outcome="no_release", cause="admitted") == 1
    assert sidecar.released() == []


def test_responses_stream_cut_after_its_lead_events_is_ambiguous_not_admitted(sidecar: Sidecar) -> None:
    # vLLM 0.33.0 lets an engine admission error escape the Responses stream: the connection
    # is cut after the two lead events. D may or may not have the request: ambiguous.
    body = responses_body("hi [[stream-error:400]]", "rs-cut")
    with (
        pytest.raises(httpx.RemoteProtocolError),
        httpx.stream("POST", sidecar.url + "/v1/responses", json=body) as r,
    ):
        assert r.status_code == 200
        r.read()
    assert sidecar.wait_idle()
    sidecar.settle()
    assert sidecar.sample("kvr_not_released_total", outcome="ambiguous", cause="reset_after_send") == 1
    assert sidecar.sample("kvr_not_released_total", outcome="no_release", cause="admitted") == 0
    assert sidecar.released() == []


def test_responses_stream_cut_after_its_lead_events_is_released_when_configured(decode: ServerThread) -> None:
    with run_sidecar(decode.url, release_ambiguous=True) as sc:
        body = responses_body("hi [[stream-error:400]]", "rs-cut-2")
        with (
            pytest.raises(httpx.RemoteProtocolError),
            httpx.stream("POST", sc.url + "/v1/responses", json=body) as r,
        ):
            r.read()
        assert sc.wait_idle()
        sc.settle()
        assert sc.released() == ["rs-cut-2"]


@RETRIED
def test_a_faulted_engine_is_not_left_to_d_and_is_judged_as_any_503(retried: object) -> None:
    """vLLM 0.34.0's EngineFaultedError (fault tolerance on, engine core faulted): D's wrapper calls
    its notify, but it waits in the faulted engine core, so D does not release it in time. Behind a
    proxy that retries 503 it is left to the retry; with nothing in front it is the sidecar's."""
    config = DecodeSimConfig(port=0, version="0.34.0", max_model_len=50, engine="faulted")
    with (
        serve(create_decode_app(config)) as d,
        run_sidecar(d.url, release="nixl", record=True, retried_statuses=retried) as sc,
    ):
        response = httpx.post(sc.url + "/v1/chat/completions", json=chat("hi", "faulted-1"), timeout=10)
        assert response.status_code == 503
        assert response.json()["error"]["message"].startswith("The engine has faulted")
        if retried == SHIPPED:
            left_to_a_retry(sc, "engine_faulted")
            return
        assert sc.wait_released(1) == ["faulted-1"]
        job = sc.releaser.recorded[0]
        assert (job.cause, job.covered) == ("engine_faulted", False)


@RETRIED
def test_after_a_faulted_answer_d_s_handler_rejections_are_released_by_the_sidecar(retried: object) -> None:
    """While D answers EngineFaultedError, its own notification of any rejection waits in the faulted
    engine core: a handler 400 that D would release itself is the sidecar's for a while."""
    config = DecodeSimConfig(port=0, version="0.34.0", max_model_len=50, engine="faulted")
    with (
        serve(create_decode_app(config)) as d,
        run_sidecar(d.url, release="nixl", record=True, retried_statuses=retried) as sc,
    ):
        faulted = chat("hi", "fault")
        assert httpx.post(sc.url + "/v1/chat/completions", json=faulted, timeout=10).status_code == 503
        first = [] if retried == SHIPPED else ["fault"]  # the shipped default leaves a 503 to the retry
        assert sc.wait_released(len(first)) == first
        assert httpx.post(d.url + "/sim/engine", json={"engine": "alive"}).status_code == 200
        long = chat("word " * 80, "after-fault")
        assert httpx.post(sc.url + "/v1/chat/completions", json=long, timeout=10).status_code == 400
        assert sc.wait_released(len(first) + 1) == [*first, "after-fault"]
        assert [job.covered for job in sc.releaser.recorded] == [False] * (len(first) + 1)


@RETRIED
def test_without_a_fault_the_same_handler_rejection_is_left_to_d(retried: object) -> None:
    """The control of the test above: D's engine alive, the same 400 is D's own to release."""
    config = DecodeSimConfig(port=0, version="0.34.0", max_model_len=50)
    with (
        serve(create_decode_app(config)) as d,
        run_sidecar(d.url, release="nixl", record=True, retried_statuses=retried) as sc,
    ):
        long = chat("word " * 80, "no-fault")
        assert httpx.post(sc.url + "/v1/chat/completions", json=long, timeout=10).status_code == 400
        sc.settle()
        assert sc.released() == []
        assert sc.sample("kvr_releases_total", strategy="dry-run", result="covered_by_engine") == 1


@RETRIED
@pytest.mark.parametrize(
    ("version", "error_type"), [("0.34.0", "BadRequestError"), ("0.25.1", "Bad Request")]
)
def test_a_request_models_validator_refusal_is_released_not_left_to_d(
    version: str, error_type: str, retried: object
) -> None:
    """``stream_options`` without ``stream``: the request model's validator refuses it before D's
    handler runs, so D's own release never sees it. From vLLM 0.27.0 it is answered with a handler's
    type ("BadRequestError"); before, as any body validation ("Bad Request"). Either way the sidecar
    releases it itself (a release left to D would hold P's blocks to the lease)."""
    config = DecodeSimConfig(port=0, version=version, max_model_len=50)
    with (
        serve(create_decode_app(config)) as d,
        run_sidecar(d.url, release="nixl", record=True, retried_statuses=retried) as sc,
    ):
        body = {**chat("hi", "validator-1"), "stream_options": {"include_usage": True}}
        response = httpx.post(sc.url + "/v1/chat/completions", json=body, timeout=10)
        assert (response.status_code, response.json()["error"]["type"]) == (400, error_type)
        assert sc.wait_released(1) == ["validator-1"]
        job = sc.releaser.recorded[0]
        assert job.covered is False
        assert job.cause == ("rejected_validation" if error_type == "BadRequestError" else "rejected_4xx")
