"""The proxy's request path driven as a plain ASGI call, D faked at the upstream seam.

Each test scripts D (``tests.support.fakes.FakeUpstream``), sends one request through
``sidecar.proxy.Proxy`` and reads three things: what the client got, what D
got, and the release jobs the pipeline decided (a recording strategy).
Behaviour over real sockets is in ``tests/integration``; here every branch
of the decision is cheap to reach.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from sidecar.classify import NoAnswer
from tests.support.fakes import Client, FakeDecode, FakeRequest, FakeResponse, FakeUpstream, refused
from tests.unit.rigs import (
    V033,
    completion,
    error,
    rig,
)


def rid(value: str) -> list[tuple[bytes, bytes]]:
    return [(b"x-request-id", value.encode())]


async def test_a_validation_rejection_is_released_and_the_client_told_not_to_retry() -> None:
    async with rig(FakeUpstream(lambda r: error(400, "Bad Request"))) as r:
        body = completion(V033, max_tokens="x")
        client = await r.call(Client(body=body, headers=rid("r1")))
        assert client.status == 400 and client.response_headers[b"x-should-retry"] == b"false"
        [sent] = r.d.requests
        assert sent.body == body and sent.header("x-request-id") == "r1"  # forwarded unchanged
        [job] = r.releaser.jobs
        assert (job.cause, job.status, job.error_type, job.params.blocks) == (
            "rejected_4xx",
            400,
            "Bad Request",
            3,
        )


async def test_an_admitted_request_is_not_released() -> None:
    async with rig(FakeUpstream(lambda r: FakeResponse.json(200, {"choices": []}))) as r:
        client = await r.call(Client(body=completion(V033)))
        assert client.status == 200 and b"x-should-retry" not in client.response_headers
        assert r.releaser.jobs == []


async def test_d_down_is_answered_503_and_released_when_nothing_in_front_retries() -> None:
    async with rig(FakeUpstream(refused, reached=False), retried_statuses=("none",)) as r:
        client = await r.call(Client(body=completion(V033)))
        assert client.status == 503 and b"decode server" in client.response_body
        assert [job.cause for job in r.releaser.jobs] == ["unreachable"]


@pytest.mark.parametrize(("can_notify", "sent", "covered"), [(True, 0, 1), (False, 1, 0)])
async def test_a_rejection_from_ds_handler_is_left_to_d_only_while_d_can_notify(
    can_notify: bool, sent: int, covered: int
) -> None:
    async with rig(
        FakeUpstream(lambda r: error(404, "NotFoundError")), FakeDecode("0.33.0", can_notify)
    ) as r:
        client = await r.call(Client(body=completion(V033)))
        assert client.status == 404
        assert len(r.releaser.jobs) == sent and r.result("covered_by_engine") == covered
        # Either way the parameters are spent: D's engine or the sidecar released them.
        assert client.response_headers[b"x-should-retry"] == b"false"


async def test_an_unknown_release_of_d_is_released_whatever_the_answer() -> None:
    async with rig(FakeUpstream(lambda r: error(404, "NotFoundError")), FakeDecode(None)) as r:
        await r.call(Client(body=completion(V033)))
        assert len(r.releaser.jobs) == 1


async def test_a_500_d_may_have_released_is_sent_after_ds_own_notification_would_have_gone() -> None:
    async with rig(FakeUpstream(lambda r: error(500, "InternalServerError"))) as r:
        await r.call(Client(body=completion(V033)))
        [job] = r.releaser.jobs
        assert job.not_before - job.detected_at == pytest.approx(0.05, abs=0.01)


async def test_a_stream_refused_after_its_200_is_released_and_a_cut_one_is_not() -> None:
    refusal = {"error": {"message": "bad", "type": "BadRequestError", "param": None, "code": 400}}
    async with rig(FakeUpstream(lambda r: FakeResponse.sse(refusal))) as r:
        client = await r.call(Client(body=completion(V033, stream=True)))
        assert client.status == 200 and b"[DONE]" in client.response_body
        assert [job.cause for job in r.releaser.jobs] == ["stream_admission_error"]
    async with rig(FakeUpstream(lambda r: FakeResponse.sse(broken=True))) as r:
        with pytest.raises(Exception, match="broke"):
            await r.call(Client(body=completion(V033, stream=True)))
        assert r.releaser.jobs == []
        labels = {"outcome": "ambiguous", "cause": "reset_after_send"}
        assert r.metrics.registry.get_sample_value("kvr_not_released_total", labels) == 1


async def test_spent_parameters_are_refused_409_without_reaching_d() -> None:
    async with rig(FakeUpstream(lambda r: error(400, "Bad Request"))) as r:
        await r.call(Client(body=completion(V033, max_tokens="x")))
        again = await r.call(Client(body=completion(V033)))
        assert again.status == 409 and again.response_headers[b"x-should-retry"] == b"false"
        assert len(r.d.requests) == 1


async def test_a_dry_run_applies_the_strategys_rules_and_never_changes_an_answer() -> None:
    """``--dry-run``: D's own fix still decides (covered), but nothing is spent: no
    ``x-should-retry: false``, and a retry with the same parameters reaches D."""
    answers = iter([error(404, "NotFoundError"), error(400, "Bad Request"), error(400, "Bad Request")])
    async with rig(FakeUpstream(lambda r: next(answers)), dry_run=True) as r:
        covered = await r.call(Client(body=completion(V033)))
        refused = await r.call(Client(body=completion(dict(V033, remote_request_id="other"), max_tokens="x")))
        again = await r.call(Client(body=completion(dict(V033, remote_request_id="other"))))
        assert r.result("covered_by_engine") == 1 and len(r.releaser.jobs) == 1
        assert (covered.status, refused.status, again.status) == (404, 400, 400)
        assert all(b"x-should-retry" not in c.response_headers for c in (covered, refused, again))
        assert len(r.d.requests) == 3


async def test_what_the_proxy_sees_of_d_reaches_ds_state_before_the_judge() -> None:
    decode = FakeDecode("0.33.0")
    async with rig(FakeUpstream(lambda r: error(404, "NotFoundError")), decode) as r:
        await r.call(Client(body=completion(V033)))
    async with rig(FakeUpstream(refused, reached=False), decode) as r:
        await r.call(Client(body=completion(V033)))
    assert decode.observed == [(404, "no", False), (NoAnswer.CONNECT_REFUSED, None, False)]


async def test_other_paths_pass_through_unjudged() -> None:
    async with rig(FakeUpstream(lambda r: FakeResponse(200, [], [b"ok"]))) as r:
        client = await r.call(Client(method="GET", path="/health", body=b""))
        assert client.status == 200 and client.response_body == b"ok"
        assert [(x.method, x.target) for x in r.d.requests] == [("GET", "/health")]
        assert r.releaser.jobs == []


@pytest.mark.parametrize(
    ("params", "reason"),
    [({**V033, "remote_port": 0}, "malformed"), ({**V033, "transfer_mode": "push"}, "push_mode")],
)
async def test_parameters_that_cannot_be_released_are_forwarded_and_counted(
    params: dict[str, Any], reason: str
) -> None:
    async with rig(FakeUpstream(lambda r: error(400, "Bad Request"))) as r:
        client = await r.call(Client(body=completion(params)))
        assert client.status == 400 and r.releaser.jobs == []
        assert r.metrics.registry.get_sample_value("kvr_ineligible_total", {"reason": reason}) == 1


async def test_untrusted_parameters_are_never_released() -> None:
    async with rig(
        FakeUpstream(lambda r: error(400, "Bad Request")), trust="token", trust_token="s3cret"
    ) as r:
        await r.call(Client(body=completion(V033)))
        assert r.releaser.jobs == []
        trusted = Client(body=completion(V033), headers=[(b"x-kvr-router-token", b"s3cret")])
        await r.call(trusted)
        assert len(r.releaser.jobs) == 1


async def test_the_client_leaving_while_d_works_is_judged_ambiguous() -> None:
    async def slow(request: FakeRequest) -> FakeResponse:
        await asyncio.sleep(10)
        raise AssertionError("never answered")

    async with rig(FakeUpstream(slow)) as r:
        client = await r.call(Client(body=completion(V033), disconnect_after_body=True))
        assert client.sent == []  # nobody to answer
        assert r.releaser.jobs == []
        labels = {"outcome": "ambiguous", "cause": "client_gone_after_forward"}
        assert r.metrics.registry.get_sample_value("kvr_not_released_total", labels) == 1


async def test_an_injected_rejection_never_reaches_d_and_is_released() -> None:
    d = FakeUpstream(lambda r: FakeResponse.json(200, {}))
    async with rig(d, inject_header=True, retried_statuses=("none",)) as r:
        client = await r.call(Client(body=completion(V033), headers=[(b"x-kvr-inject-reject", b"503")]))
        assert client.status == 503 and client.response_headers[b"x-kvr-injected"] == b"true"
        assert r.d.requests == [] and [job.cause for job in r.releaser.jobs] == ["injected"]


async def test_a_draining_sidecar_refuses_and_releases_when_nothing_in_front_retries() -> None:
    async with rig(FakeUpstream(lambda r: FakeResponse.json(200, {})), retried_statuses=("none",)) as r:
        r.proxy.stopping = True
        client = await r.call(Client(body=completion(V033)))
        assert client.status == 503 and r.d.requests == []
        assert [job.cause for job in r.releaser.jobs] == ["shutting_down"]
