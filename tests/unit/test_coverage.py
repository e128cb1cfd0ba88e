"""``engine_covers``: which rejections D releases itself (vLLM 0.21.0+), as a table.

Each row's vLLM source is pinned in ``tests/conformance/test_vllm_coverage_source.py``.
"""

from __future__ import annotations

import pytest

from sidecar.decision.coverage import engine_covers, engine_may_cover, fix_version
from sidecar.release.base import ReleaseJob
from tests.support.fakes import release_params

CHAT, CMPL, RESP = "/v1/chat/completions", "/v1/completions", "/v1/responses"
MSG, GEN = "/v1/messages", "/inference/v1/generate"


def job(
    status: int | None,
    error_type: str | None,
    *,
    route: str = CHAT,
    cause: str | None = None,
    injected: bool = False,
) -> ReleaseJob:
    if cause is None:
        cause = "rejected_5xx" if (status or 0) >= 500 else "rejected_4xx"
    return ReleaseJob(
        request_id="x",
        route=route,
        params=release_params(
            {
                "do_remote_prefill": True,
                "remote_engine_id": "p",
                "remote_host": "10.0.0.7",
                "remote_port": 5600,
                "remote_block_ids": [1],
            }
        ),
        cause=cause,
        status=status,
        error_type=error_type,
        injected=injected,
        detected_at=0.0,
        deadline=1.0,
    )


V021, V024, V025, V028, V029, V031, V033 = (
    (0, 21, 0), (0, 24, 0), (0, 25, 0), (0, 28, 0), (0, 29, 0), (0, 31, 0), (0, 33, 0)
)  # fmt: skip

TABLE = [
    # version, job, covered, why
    ((0, 20, 2), job(400, "BadRequestError"), False, "no fix before 0.21.0"),
    ((0, 13, 0), job(404, "NotFoundError"), False, "no fix before 0.21.0"),
    (V021, job(400, "BadRequestError"), True, "handler error"),
    (V021, job(400, "BadRequestError", route=CMPL), True, "completions handler"),
    (V021, job(400, "BadRequestError", route=RESP), True, "responses handler"),
    (V021, job(400, "BadRequestError", route="/v1/chat/completions?x=1"), True, "query string"),
    (V033, job(400, "BadRequestError"), True, "handler error"),
    (V021, job(404, "NotFoundError"), True, "unknown model, checked inside"),
    (V033, job(404, "NotFoundError", route=RESP), True, "unknown model"),
    (V021, job(400, "Bad Request"), False, "pydantic / content-type validation, before the handler"),
    (V033, job(400, "Bad Request"), False, "validation, before the handler"),
    (V021, job(401, None), False, 'auth middleware {"error": "Unauthorized"}'),
    (V033, job(503, None), False, "elastic-EP scaling middleware"),
    (V033, job(404, None), False, "unknown path, FastAPI's detail body"),
    (V033, job(404, "Not Found"), False, "an HTTPException, not the model check"),
    (V033, job(501, "NotImplementedError"), False, "the route raises it when the API is not served"),
    (V033, job(500, "InternalServerError"), False, "a dead engine cannot notify"),
    (V021, job(500, "InternalServerError"), False, "a dead engine cannot notify"),
    (V024, job(422, "UnprocessableEntityError"), False, "no 422 mapping before 0.25.0"),
    (V025, job(422, "UnprocessableEntityError"), True, "media fetch failure, inside"),
    (V028, job(503, "Service Unavailable"), False, "no admission control before 0.29.0"),
    (V029, job(503, "Service Unavailable"), True, "admission, inside; the notify bypasses it"),
    (V033, job(503, "Service Unavailable"), True, "admission"),
    ((0, 34, 0), job(503, "Service Unavailable"), True, "admission"),
    ((0, 34, 0), job(503, "Service Unavailable", cause="engine_faulted"), False, "faulted engine core"),
    ((0, 34, 0), job(400, "BadRequestError", cause="rejected_validation"), False, "a model validator"),
    (V029, job(400, "BadRequestError", route=RESP, cause="rejected_validation"), False, "before the handler"),
    ((0, 34, 0), job(503, "overloaded_error", route=MSG, cause="engine_faulted"), False, "faulted"),
    ((0, 34, 0), job(503, "Service Unavailable", cause="stream_engine_faulted"), False, "faulted, stream"),
    (V033, job(503, "ServiceUnavailableError"), True, "paused engine: the core re-adds it, the wrapper too"),
    (V033, job(503, "ServiceUnavailableError", route="/v1/messages"), True, "paused: the core, any route"),
    (V031, job(503, "ServiceUnavailableError"), False, "no RetryableRequestError before 0.33.0"),
    (V021, job(400, "invalid_request_error", route=RESP), True, "responses: prompt over max_model_len"),
    (V033, job(400, "invalid_request_error", route=RESP), True, "responses: input validation, renderer"),
    (V029, job(404, "invalid_request_error", route=RESP), True, "responses: previous_response_id unknown"),
    ((0, 20, 2), job(400, "invalid_request_error", route=RESP), False, "no fix before 0.21.0"),
    (V033, job(400, "invalid_request_error"), False, "the chat handler never answers that type"),
    (V033, job(404, "invalid_request_error", route=CMPL), False, "nor the completions handler"),
    (V033, job(404, "invalid_request_error", route="/v1/responses/r1"), False, "retrieve: another route"),
    (V033, job(400, "invalid_request_error", route=MSG), False, "messages: chat handler or conversion"),
    (V033, job(503, "invalid_request_error", route=RESP), False, "a status vLLM does not pair with it"),
    (V033, job(200, "InternalServerError", cause="stream_engine_paused"), True, "paused stream: the core"),
    (V031, job(200, "InternalServerError", cause="stream_engine_paused"), False, "no pause rejection"),
    (V033, job(200, "Service Unavailable", cause="stream_admission_overflow"), False, "never reached D"),
    (V033, job(429, "BadRequestError"), False, "a status vLLM does not pair with that type"),
    (V033, job(400, "BadRequestError", route=MSG), False, "messages: may be covered, never is"),
    (V033, job(400, "BadRequestError", route="/inference/v1/generate"), False, "token route not wrapped"),
    (V033, job(400, "BadRequestError", cause="stream_admission_error"), False, "after HTTP 200"),
    (V033, job(None, None, cause="unreachable"), False, "D unreachable"),
    (V033, job(413, "BadRequestError", cause="body_too_large"), False, "the sidecar's own 413"),
    (V033, job(503, "Service Unavailable", cause="shutting_down"), False, "the sidecar shutting down"),
    (V033, job(400, "BadRequestError", cause="client_gone_before_forward"), False, "never reached D"),
    (V033, job(400, "BadRequestError", injected=True), False, "injected: D never saw it"),
    (V033, job(400, "BadRequestError", cause="injected"), False, "injected cause"),
    (V021, job(None, None, cause="header_timeout"), True, "the sidecar's abort cancels D's handler"),
    (V033, job(None, None, cause="client_gone_after_forward", route=RESP), True, "cancelled handler"),
    ((0, 20, 2), job(None, None, cause="header_timeout"), False, "no cleanup of a cancelled handler"),
    (V033, job(None, None, cause="header_timeout", route="/v1/messages"), False, "messages: may be, not is"),
    (V033, job(None, None, cause="header_timeout", route=GEN), False, "token route not wrapped"),
    (V033, job(None, None, cause="reset_after_send"), False, "D's connection broke: no proof it ran"),
    (V033, job(None, None, cause="gateway_error"), False, "a layer in between answered"),
]


@pytest.mark.parametrize(("version", "rejection", "covered", "why"), TABLE, ids=[row[3] for row in TABLE])
def test_engine_covers(version: tuple[int, int, int], rejection: ReleaseJob, covered: bool, why: str) -> None:
    assert engine_covers(version, rejection) is covered, why


MAY = [
    # version, job, D may have released it, why
    (V021, job(500, "InternalServerError"), True, "a handler's error, or a dead engine, or the catch-all"),
    (V033, job(500, "InternalServerError", route=RESP), True, "the same on every wrapped route"),
    (V033, job(501, "NotImplementedError"), True, "a handler's NotImplementedError, or the router's"),
    ((0, 20, 2), job(500, "InternalServerError"), False, "no fix before 0.21.0: D never notifies"),
    # /v1/messages converts, then awaits the wrapped chat handler (anthropic/serving.py
    # create_messages -> create_chat_completion): its handler errors may have been notified.
    (V029, job(500, "InternalServerError", route=MSG), True, "messages: chat handler or conversion"),
    (V029, job(400, "BadRequestError", route=MSG), True, "messages, vLLM's type in Anthropic's envelope"),
    (V033, job(400, "invalid_request_error", route=MSG), True, "messages, 0.33.0's Anthropic type"),
    (V033, job(503, "overloaded_error", route=MSG), True, "messages: admission or the paused engine"),
    (V031, job(400, "invalid_request_error", route=MSG), False, "messages: no Anthropic type names yet"),
    ((0, 20, 2), job(400, "BadRequestError", route=MSG), False, "messages: no fix before 0.21.0"),
    (V033, job(400, "Bad Request", route=MSG), False, "messages: validation, before the handler"),
    (V033, job(None, None, cause="header_timeout", route=MSG), True, "messages: abort of either part"),
    (V033, job(400, "BadRequestError", route=GEN), False, "the token route is not wrapped"),
    (V033, job(None, None, cause="header_timeout", route=GEN), False, "token route: abort not notified"),
    (V033, job(500, None), False, "not vLLM's error body"),
    (V033, job(400, "BadRequestError"), False, "covered outright"),
    (V033, job(400, "Bad Request"), False, "before the handler: D never notifies"),
    (V033, job(500, "InternalServerError", cause="stream_error_5xx"), False, "after HTTP 200"),
    (V033, job(500, "InternalServerError", injected=True), False, "injected: D never saw it"),
]


@pytest.mark.parametrize(("version", "rejection", "may", "why"), MAY, ids=[row[3] for row in MAY])
def test_engine_may_cover(version: tuple[int, int, int], rejection: ReleaseJob, may: bool, why: str) -> None:
    assert engine_may_cover(version, rejection) is may, why
    assert not (may and engine_covers(version, rejection)), "a row is either covered or may be"


@pytest.mark.parametrize(
    ("text", "version"),
    [
        ("0.21.0", (0, 21, 0)),
        ("0.21.0rc1", (0, 20, 2)),  # a pre-release may hold the previous release's code
        ("0.34.0", (0, 34, 0)),
        ("0.99.0", (0, 34, 0)),  # newer than any known release: the newest known behaviour
        ("0.35.0rc1", (0, 34, 0)),  # a pre-release of a newer release too
        ("0.8.0", None),  # older than any release the sidecar knows
        ("garbage", None),
        ("", None),
        (None, None),
    ],
)
def test_the_release_d_is_judged_by(text: str | None, version: tuple[int, int, int] | None) -> None:
    assert fix_version(text) == version


@pytest.mark.parametrize("route", [f"{CHAT}?stream=1", f"{CHAT}?a=1?b=2"])
def test_a_query_string_does_not_change_the_route(route: str) -> None:
    assert engine_covers(V033, job(400, "BadRequestError", route=route))
    assert engine_covers(V021, job(None, None, cause="header_timeout", route=route))
    assert engine_may_cover(V033, job(500, "InternalServerError", route=route))
    generate = f"/inference/v1/generate?{route}"
    assert not engine_may_cover(V033, job(500, "InternalServerError", route=generate))
