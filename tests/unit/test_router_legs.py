"""Router mode driven as a plain ASGI call: P and D faked at the upstream seam.

``PrefillPool`` takes a fake client per P (``connect``), the proxy a fake D;
the tests read both legs' requests, the client's answer and the release jobs.
"""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
import pytest

from sidecar.router import PREFILL_PARAMS
from sidecar.router.pool import TAIL_BYTES
from tests.support.fakes import Client, FakeRequest, FakeResponse, FakeUpstream, refused
from tests.unit.rigs import (
    P1,
    P2,
    V033,
    completion,
    error,
    prefilled,
    router,
)


def ok(request: FakeRequest) -> FakeResponse:
    usage = {"prompt_tokens": 9, "prompt_tokens_details": {"cached_tokens": 0}}
    return FakeResponse.json(200, {"choices": [{"text": "x"}], "usage": usage})


async def test_both_legs_carry_what_vllms_proxy_sends_and_cached_tokens_come_from_p() -> None:
    async with router(FakeUpstream(ok)) as r:
        client = await r.call(
            Client(
                body=completion({"do_remote_prefill": True}, stream=False), headers=[(b"x-request-id", b"r1")]
            )
        )
        assert client.status == 200
        [prefill] = r.ps[P1].requests + r.ps[P2].requests
        leg = prefill.json()
        assert (leg["stream"], leg["max_tokens"], leg["kv_transfer_params"]) == (False, 1, PREFILL_PARAMS)
        [decode] = r.d.requests
        assert decode.json()["kv_transfer_params"] == V033  # P's, never the client's
        assert decode.header("x-request-id") == prefill.header("x-request-id") == "r1"
        usage = msgspec.json.decode(client.response_body)["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] == 4
        assert r.releaser.jobs == []


async def test_d_rejecting_is_released_without_telling_the_client_not_to_retry() -> None:
    async with router(FakeUpstream(lambda r: error(400, "Bad Request"))) as r:
        client = await r.call(Client(body=completion()))
        assert client.status == 400
        assert b"x-should-retry" not in client.response_headers  # a retry runs a fresh prefill
        assert [job.cause for job in r.releaser.jobs] == ["rejected_4xx"]


async def test_with_decode_releases_ds_answers_are_left_to_the_decode_sidecar() -> None:
    async with router(FakeUpstream(lambda r: error(400, "Bad Request")), decode_releases=True) as r:
        await r.call(Client(body=completion()))
        assert r.releaser.jobs == []
    async with router(FakeUpstream(refused, reached=False), decode_releases=True) as r:
        client = await r.call(Client(body=completion()))  # it never reached the decode sidecar
        assert client.status == 503 and [job.cause for job in r.releaser.jobs] == ["unreachable"]


async def test_a_failing_p_is_tried_once_on_the_other_then_503() -> None:
    down = error(503, "ServiceUnavailableError")
    async with router(FakeUpstream(ok), p1=lambda r: down, p2=prefilled) as r:
        first = await r.call(Client(body=completion()))
        assert first.status == 200 and len(r.ps[P1].requests) == len(r.ps[P2].requests) == 1
    async with router(FakeUpstream(ok), p1=lambda r: down, p2=lambda r: down) as r:
        client = await r.call(Client(body=completion()))
        assert client.status == 503 and r.d.requests == []


async def test_ps_own_refusal_reaches_the_client_as_it_is() -> None:
    refusal = error(400, "BadRequestError")
    async with router(FakeUpstream(ok), p1=lambda r: refusal, p2=lambda r: refusal) as r:
        client = await r.call(Client(body=completion()))
        assert client.status == 400 and client.response_body == refusal.body[0]
        assert r.d.requests == []


@pytest.mark.parametrize(("fallback", "status", "to_d"), [(False, 400, 0), (True, 200, 1)])
async def test_n_above_one_never_takes_the_pd_path(fallback: bool, status: int, to_d: int) -> None:
    async with router(FakeUpstream(ok), decode_only_fallback=fallback) as r:
        client = await r.call(Client(body=completion(n=2)))
        assert client.status == status and len(r.d.requests) == to_d
        assert r.ps[P1].requests == r.ps[P2].requests == []
        if to_d:
            assert "kv_transfer_params" not in r.d.requests[0].json()


def large(request: FakeRequest, **members: Any) -> FakeResponse:
    """P's answer with prompt_logprobs on a long prompt: about 3 MB of JSON before its parameters
    (and vLLM's members after them), in 64 KiB chunks as a socket gives them."""
    logprobs = [{"151643": {"logprob": -1.5, "rank": 1, "decoded_token": "tok"}}] * 50_000
    usage = {"prompt_tokens": 50_000, "prompt_tokens_details": {"cached_tokens": 0}}
    payload = {
        "choices": [],
        "usage": usage,
        "prompt_logprobs": logprobs,
        "kv_transfer_params": V033,
        "ec_transfer_params": None,
        "metrics": None,
        **members,
    }
    whole = FakeResponse.json(200, payload)
    data = whole.body[0]
    whole.body = [data[at : at + 65536] for at in range(0, len(data), 65536)]
    return whole


async def test_a_p_answer_over_one_mib_is_read_whole_under_the_default_limit() -> None:
    assert len(b"".join(large(FakeRequest("POST", "/", [], b"")).body)) > 2 * 1024 * 1024
    async with router(FakeUpstream(ok), p1=large, p2=large) as r:
        client = await r.call(Client(body=completion()))
        assert client.status == 200
        assert r.d.requests[0].json()["kv_transfer_params"] == V033


async def test_a_p_answer_over_the_limit_is_a_502_naming_the_setting_tried_once() -> None:
    async with router(
        FakeUpstream(ok), p1=large, p2=large, prefill_max_retries=2, prefill_answer_limit=1 << 20
    ) as r:
        client = await r.call(Client(body=completion()))
        assert client.status == 502
        assert (
            "prefill_answer_limit (1048576 bytes)"
            in msgspec.json.decode(client.response_body)["error"]["message"]
        )
        assert len(r.ps[P1].requests) + len(r.ps[P2].requests) == 1  # neither retried nor sent elsewhere
        assert r.d.requests == []
        # No decode leg carried P's parameters, so D never reads those blocks: they are released.
        [job] = r.releaser.jobs
        assert (job.cause, job.params.remote_request_id) == ("prefill_answer_too_large", "cmpl-r1-0-abcd1234")
        later = await r.call(Client(body=completion()))  # no P was put in backoff for it
        assert later.status == 502
        assert len(r.ps[P1].requests) == len(r.ps[P2].requests) == 1


def _cut(request: FakeRequest) -> FakeResponse:
    """The large answer, breaking off before its end."""
    answer = large(request)
    answer.body, answer.broken = answer.body[:-1], True
    return answer


def _status(answer: FakeResponse, status: int) -> FakeResponse:
    answer.status = status
    return answer


def _nested_only(request: FakeRequest) -> FakeResponse:
    """Parameters only inside another member (none of the answer's own): not P's to release."""
    return large(request, kv_transfer_params=None, metrics={"kv_transfer_params": V033})


@pytest.mark.parametrize(
    ("p", "why"),
    [
        (_cut, "P's answer broke off before its parameters"),
        (lambda r: large(r, kv_transfer_params=None), "P kept nothing"),
        (_nested_only, "only a nested member names them"),
        (lambda r: _status(large(r), 500), "P failed it (no block kept for D)"),
    ],
)
async def test_an_answer_over_the_limit_without_readable_parameters_is_not_released(p: Any, why: str) -> None:
    async with router(FakeUpstream(ok), p1=p, p2=p, prefill_answer_limit=2 << 20) as r:
        client = await r.call(Client(body=completion()))
        assert client.status == 502 and r.d.requests == [], why
        assert r.releaser.jobs == [], why


async def test_a_client_gone_while_p_answers_over_the_limit_still_frees_p() -> None:
    async def slow(request: FakeRequest) -> FakeResponse:
        await asyncio.sleep(0.05)  # the client has left by then
        return large(request)

    async with router(FakeUpstream(ok), p1=slow, p2=slow, prefill_answer_limit=1 << 20) as r:
        await r.call(Client(body=completion(), disconnect_after_body=True))
        assert r.d.requests == []
        assert [job.cause for job in r.releaser.jobs] == ["prefill_answer_too_large"]


async def test_an_answer_many_times_the_tail_is_read_to_its_parameters() -> None:
    def huge(request: FakeRequest) -> FakeResponse:
        return large(request, prompt_logprobs=[{"1": {"logprob": -1.0, "decoded_token": "t"}}] * 400_000)

    assert len(b"".join(huge(FakeRequest("POST", "/", [], b"")).body)) > 3 * TAIL_BYTES
    async with router(FakeUpstream(ok), p1=huge, p2=huge, prefill_answer_limit=1 << 20) as r:
        client = await r.call(Client(body=completion()))
        assert client.status == 502
        assert [job.params.remote_request_id for job in r.releaser.jobs] == ["cmpl-r1-0-abcd1234"]


async def test_a_client_gone_while_p_computes_waits_for_p_then_frees_its_blocks() -> None:
    async def slow(request: FakeRequest) -> FakeResponse:
        await asyncio.sleep(0.05)  # the client has left by then
        return prefilled(request)

    async with router(FakeUpstream(ok), p1=slow, p2=slow) as r:
        client = await r.call(Client(body=completion(), disconnect_after_body=True))
        assert r.d.requests == [] and client.sent == []
        assert [job.cause for job in r.releaser.jobs] == ["client_gone_before_forward"]
        assert len(r.ps[P1].requests + r.ps[P2].requests) == 1  # P answered once, not retried


async def test_the_prefill_leg_runs_in_the_requests_own_task() -> None:
    tasks: list[asyncio.Task[Any] | None] = []

    def seen(request: FakeRequest) -> FakeResponse:
        tasks.append(asyncio.current_task())
        return prefilled(request)

    async with router(FakeUpstream(ok), p1=seen, p2=seen) as r:
        client = Client(body=completion(stream=False))
        call = asyncio.create_task(r.call(client))
        await call
        assert client.status == 200 and tasks == [call]


async def test_a_cancellation_from_outside_cuts_the_prefill_leg_and_releases_nothing() -> None:
    entered, cut = asyncio.Event(), asyncio.Event()

    async def hangs(request: FakeRequest) -> FakeResponse:
        entered.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cut.set()
            raise
        raise AssertionError("unreachable")

    async with router(FakeUpstream(ok), p1=hangs, p2=hangs) as r:
        client = Client(body=completion())
        call = asyncio.create_task(r.proxy(client.scope(), client.receive, client.send))
        await entered.wait()
        call.cancel()  # shutdown past drain_timeout
        await asyncio.gather(call, return_exceptions=True)
        assert cut.is_set() and client.status == 503  # answered as shutting down
        assert r.d.requests == [] and r.releaser.jobs == []


async def test_each_leg_gets_the_clients_headers_with_its_own_body_length() -> None:
    async with router(FakeUpstream(ok)) as r:
        headers = [(b"x-request-id", b"r1"), (b"x-tenant", b"t1")]
        client = await r.call(Client(body=completion(stream=False), headers=headers))
        assert client.status == 200
        [prefill] = r.ps[P1].requests + r.ps[P2].requests
        [decode] = r.d.requests
        for leg in (prefill, decode):
            assert leg.header("x-tenant") == "t1" and leg.header("x-request-id") == "r1"
            assert [v for n, v in leg.headers if n == "content-length"] == [str(len(leg.body or b""))]
