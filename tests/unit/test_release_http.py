"""``HttpReleaser``'s HTTP edge cases against respx: statuses, transport errors, ids, coverage, token."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import respx
from prometheus_client import CollectorRegistry

from sidecar.config import Config
from sidecar.params import ReleaseParams
from sidecar.release.base import JobResult, PermanentReleaseError, ReleaseJob
from sidecar.release.http import (
    ControlFailed,
    ControlUnreachable,
    HttpReleaser,
    answer_kind,
    health_url,
)
from tests.support.fakes import release_params

D = "http://d.test:8200"
RELEASE = D + "/kv_release/v1/release"
HEALTH = D + "/kv_release/v1/health"
TOKEN = "sidecar-token-0123456789"
ACCEPTED = {"request_id": "x", "action": "notify", "outcome": "notified", "duplicate": False}


def fields_of(**fields: Any) -> dict[str, Any]:
    """``kv_transfer_params`` as P sends them (vLLM 0.13.0+, TP 2), with ``fields`` changed;
    a field set to None is left out."""
    base: dict[str, Any] = {
        "do_remote_prefill": True,
        "remote_engine_id": "p-engine",
        "remote_request_id": "cmpl-r1-0-abcd1234",
        "remote_host": "10.0.0.7",
        "remote_port": 5600,
        "remote_block_ids": [[4, 5]],
        "tp_size": 2,
    }
    return {k: v for k, v in {**base, **fields}.items() if v is not None}


def params(**fields: Any) -> dict[str, Any]:
    return fields_of(**fields)


def job(route: str = "/v1/completions", **fields: Any) -> ReleaseJob:
    now = time.monotonic()
    sent: dict[str, Any] = fields.pop("params", params())
    released: ReleaseParams = release_params(sent)
    fields.setdefault("raw_params", json.dumps(sent).encode())
    return ReleaseJob(
        request_id=fields.pop("request_id", "r1"),
        route=route,
        params=released,
        cause=fields.pop("cause", "rejected_4xx"),
        status=fields.pop("status", 400),
        error_type=fields.pop("error_type", "Bad Request"),
        detected_at=now,
        deadline=now + 30,
        **fields,
    )


def version(text: str | None) -> Callable[[], Awaitable[str | None]]:
    async def decode_version() -> str | None:
        return text

    return decode_version


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


@pytest.fixture
async def releaser(registry: CollectorRegistry) -> AsyncIterator[HttpReleaser]:
    config = Config(decode_url=D, release="http", control_token=TOKEN, control_timeout=0.5)
    http = HttpReleaser(config, version("0.33.0"), registry)
    await http.start()
    yield http
    await http.close()


@pytest.mark.parametrize(
    ("status", "label", "error"),
    [
        (202, "accepted", None),
        (200, "accepted", None),
        (400, "bad_request", PermanentReleaseError),
        (413, "bad_request", PermanentReleaseError),
        (401, "unauthorized", PermanentReleaseError),
        (403, "forbidden", PermanentReleaseError),
        (404, "not_found", PermanentReleaseError),
        (405, "not_found", PermanentReleaseError),
        (409, "rejected", PermanentReleaseError),
        (408, "throttled", ControlFailed),
        (429, "throttled", ControlFailed),
        (500, "server_error", ControlFailed),
        (503, "server_error", ControlFailed),
    ],
)
def test_answer_kind(status: int, label: str, error: type[Exception] | None) -> None:
    assert answer_kind(status) == (label, error)


def test_urls() -> None:
    assert health_url(Config(decode_url=D + "/")) == HEALTH
    custom = Config(control_url="http://127.0.0.1:9000/x/kv_release/v1/release/")
    assert health_url(custom) == "http://127.0.0.1:9000/x/kv_release/v1/health"


@respx.mock(assert_all_called=True)
async def test_accepted_posts_the_job(releaser: HttpReleaser, respx_mock: respx.MockRouter) -> None:
    route = respx_mock.post(RELEASE).respond(202, json=ACCEPTED)
    assert await releaser.release(job()) is JobResult.SENT
    request = route.calls.last.request
    assert request.headers["authorization"] == f"Bearer {TOKEN}"
    assert request.headers["content-type"] == "application/json"
    body = json.loads(request.content)
    assert body == {
        "request_id": "cmpl-r1-0-abcd1234",  # P's id: D's connector names the request to P by it
        "kv_transfer_params": params(),  # as they came: absent fields stay absent
        "data_parallel_rank": None,
    }


@respx.mock(assert_all_called=True)
async def test_raw_params_and_dp_rank_reach_the_engine(
    releaser: HttpReleaser, respx_mock: respx.MockRouter
) -> None:
    """Fields this sidecar does not know (a newer vLLM's) and the request's DP rank are kept."""
    raw = json.dumps({**params(), "future_field": {"x": 1}}).encode()
    route = respx_mock.post(RELEASE).respond(202, json=ACCEPTED)
    assert await releaser.release(job(raw_params=raw, data_parallel_rank=3)) is JobResult.SENT
    body = json.loads(route.calls.last.request.content)
    assert body["kv_transfer_params"] == json.loads(raw)
    assert body["data_parallel_rank"] == 3


@respx.mock(assert_all_called=True)
async def test_a_rank_d_refuses_is_retried_on_the_default_rank(
    releaser: HttpReleaser, respx_mock: respx.MockRouter
) -> None:
    """A DP rank out of D's range (the client's header) must not lose the release."""
    refused = {"error": {"message": "data_parallel_rank 9 out of range", "type": "BadRequestError"}}
    route = respx_mock.post(RELEASE).mock(
        side_effect=[httpx.Response(400, json=refused), httpx.Response(202, json=ACCEPTED)]
    )
    assert await releaser.release(job(data_parallel_rank=9)) is JobResult.SENT
    ranks = [json.loads(call.request.content)["data_parallel_rank"] for call in route.calls]
    assert ranks == [9, None]


@respx.mock(assert_all_called=True)
async def test_a_400_without_a_rank_is_not_retried(
    releaser: HttpReleaser, respx_mock: respx.MockRouter
) -> None:
    route = respx_mock.post(RELEASE).respond(
        400, json={"error": {"message": "bad", "type": "BadRequestError"}}
    )
    with pytest.raises(PermanentReleaseError):
        await releaser.release(job())
    assert route.call_count == 1


@pytest.mark.parametrize(
    ("status", "reason"),
    [
        (400, "bad_request"),
        (401, "unauthorized"),
        (403, "forbidden"),
        (404, "not_found"),
        (422, "bad_request"),
    ],
)
async def test_permanent_statuses(
    releaser: HttpReleaser, registry: CollectorRegistry, status: int, reason: str
) -> None:
    with respx.mock:
        respx.post(RELEASE).respond(
            status, json={"error": {"message": "nope", "type": "x", "param": None, "code": 1}}
        )
        with pytest.raises(PermanentReleaseError) as caught:
            await releaser.release(job())
    assert caught.value.reason == reason
    assert "nope" in str(caught.value)
    assert registry.get_sample_value("kvr_control_requests_total", {"result": reason}) == 1


@pytest.mark.parametrize(
    ("status", "reason"), [(500, "server_error"), (503, "server_error"), (429, "throttled")]
)
async def test_retryable_statuses(releaser: HttpReleaser, status: int, reason: str) -> None:
    with respx.mock:
        respx.post(RELEASE).respond(status, text="upstream trouble")
        with pytest.raises(ControlFailed) as caught:
            await releaser.release(job())
    assert caught.value.reason == reason and "upstream trouble" in str(caught.value)


@pytest.mark.parametrize(
    ("exc", "error", "reason"),
    [
        (httpx.ConnectError("refused"), ControlUnreachable, "unreachable"),
        (httpx.ConnectTimeout("slow connect"), ControlUnreachable, "unreachable"),
        (httpx.PoolTimeout("pool"), ControlUnreachable, "unreachable"),
        (httpx.ReadTimeout("slow answer"), ControlFailed, "timeout"),
        (httpx.WriteTimeout("slow write"), ControlFailed, "timeout"),
        (httpx.RemoteProtocolError("dropped"), ControlFailed, "transport"),
        (httpx.ReadError("reset"), ControlFailed, "transport"),
    ],
)
async def test_transport_errors(
    releaser: HttpReleaser, exc: Exception, error: type[Exception], reason: str
) -> None:
    with respx.mock:
        respx.post(RELEASE).mock(side_effect=exc)
        with pytest.raises(error) as caught:
            await releaser.release(job())
    assert getattr(caught.value, "reason", None) == reason


@pytest.mark.parametrize(
    ("d_version", "the_job", "sent_id"),
    [
        ("0.20.2", job(status=400, error_type="BadRequestError"), "cmpl-r1-0-abcd1234"),
        (None, job(status=400, error_type="BadRequestError"), "cmpl-r1-0-abcd1234"),  # unknown release
        ("0.11.0", job(params=params(remote_request_id=None)), "cmpl-r1-0"),
        ("0.11.0", job("/v1/chat/completions", params=params(remote_request_id=None)), "chatcmpl-r1"),
        ("0.11.0", job("/v1/responses", params=params(remote_request_id=None), body_request_id="b"), "b"),
        (None, job("/v1/chat/completions", params=params(remote_request_id=None)), "chatcmpl-r1"),
        ("0.11.0", job("/v1/messages", params=params(remote_request_id=None)), "chatcmpl-r1"),
    ],
)
async def test_request_id_per_release(d_version: str | None, the_job: ReleaseJob, sent_id: str) -> None:
    """The id D's engine gets: P's (``remote_request_id``), or derived before vLLM 0.13.0. (Whether
    D's own fix covers a job is the judge's decision; a strategy never sees covered jobs.)"""
    http = HttpReleaser(Config(decode_url=D, control_token=TOKEN), version(d_version), CollectorRegistry())
    await http.start()
    try:
        with respx.mock:
            route = respx.post(RELEASE).respond(202, json=ACCEPTED)
            result = await http.release(the_job)
    finally:
        await http.close()
    assert result is JobResult.SENT
    assert json.loads(route.calls.last.request.content)["request_id"] == sent_id


@pytest.mark.parametrize(
    ("the_job", "reason"),
    [
        (job("/v1/responses", params=params(remote_request_id=None)), "no_request_id"),
        # the sidecar made the X-Request-Id up: P's id (before 0.13.0) cannot be derived from it
        (job(params=params(remote_request_id=None), request_id_generated=True), "no_request_id"),
        (
            job("/v1/chat/completions", params=params(remote_request_id=None), request_id_generated=True),
            "no_request_id",
        ),
        (job(raw_params=None), "no_params"),  # nothing to hand D's engine as it came
    ],
)
async def test_refused_before_sending(releaser: HttpReleaser, the_job: ReleaseJob, reason: str) -> None:
    releaser._config = Config(decode_url=D, vllm_version="0.11.0")
    with respx.mock:
        route = respx.post(RELEASE).respond(202, json=ACCEPTED)
        with pytest.raises(PermanentReleaseError) as caught:
            await releaser.release(the_job)
    assert caught.value.reason == reason and route.call_count == 0


async def test_token_file_is_read_once_at_start(tmp_path: Path) -> None:
    secret = tmp_path / "token"
    secret.write_text(TOKEN + "\n")
    http = HttpReleaser(Config(decode_url=D, control_token_file=str(secret)), version("0.33.0"))
    await http.start()
    secret.write_text("changed")
    try:
        with respx.mock:
            route = respx.post(RELEASE).respond(202, json=ACCEPTED)
            await http.release(job())
    finally:
        await http.close()
    assert route.calls.last.request.headers["authorization"] == f"Bearer {TOKEN}"


async def test_unreadable_token_file_stops_start(tmp_path: Path) -> None:
    http = HttpReleaser(Config(decode_url=D, control_token_file=str(tmp_path / "missing")), version(None))
    with pytest.raises(OSError):
        await http.start()
    assert not http.ready()


async def test_without_token_no_authorization_header() -> None:
    http = HttpReleaser(Config(decode_url=D), version("0.33.0"))
    await http.start()
    try:
        with respx.mock:
            route = respx.post(RELEASE).respond(202, json=ACCEPTED)
            await http.release(job())
    finally:
        await http.close()
    assert "authorization" not in route.calls.last.request.headers


async def test_client_ignores_proxy_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HTTP_PROXY", "http://proxy.invalid:3128")
    monkeypatch.setenv("ALL_PROXY", "http://proxy.invalid:3128")
    http = HttpReleaser(Config(decode_url=D, control_token=TOKEN, control_timeout=0.25), version("0.33.0"))
    await http.start()
    try:
        client = http._client
        assert client is not None and not client.trust_env
        assert client.timeout == httpx.Timeout(0.25)  # every phase bounded, pool included
    finally:
        await http.close()


@pytest.mark.parametrize(
    ("answer", "probe"),
    [
        (httpx.Response(200, json={"status": "ok", "action": "notify"}), "present"),
        (httpx.Response(404, json={"detail": "Not Found"}), "absent"),
        (httpx.Response(405), "absent"),
        (httpx.Response(401), "unauthorized"),
        (httpx.Response(403), "forbidden"),
        (httpx.Response(503), "no_engine"),
        (httpx.Response(500), "error"),
        (httpx.ConnectError("refused"), "unreachable"),
        (httpx.ReadTimeout("slow"), "error"),
    ],
)
async def test_probe(releaser: HttpReleaser, registry: CollectorRegistry, answer: Any, probe: str) -> None:
    with respx.mock:
        route = respx.get(HEALTH)
        route.mock(side_effect=answer) if isinstance(answer, Exception) else route.mock(return_value=answer)
        assert await releaser.probe() == probe
    assert route.calls.last.request.headers["authorization"] == f"Bearer {TOKEN}"
    assert registry.get_sample_value("kvr_control_probes_total", {"result": probe}) == 1


def test_make_releaser_builds_http_without_zmq_or_nixl() -> None:
    code = (
        "import sys\n"
        "from prometheus_client import CollectorRegistry\n"
        "from sidecar.config import Config\n"
        "from sidecar.release import make_releaser\n"
        "async def version(): return None\n"
        "http = make_releaser(Config(release='http'), version, CollectorRegistry())\n"
        "heavy = [m for m in sys.modules if m.startswith(('zmq', 'nixl', 'sidecar.release.nixl'))]\n"
        "auto = make_releaser(Config(release='auto'), version, CollectorRegistry())\n"
        "print(len(heavy), type(http).__name__, type(auto).__name__, type(auto.nixl).__name__)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert done.stdout.split() == ["0", "HttpReleaser", "AutoReleaser", "NixlReleaser"]
