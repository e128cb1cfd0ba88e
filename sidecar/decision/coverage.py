"""Whether D's own fix (vLLM 0.21.0+) already releases a rejected request: a pure function.

From 0.21.0, ``_with_kv_transfer_rejection_cleanup`` wraps exactly three
handlers, ``create_chat_completion``, ``create_completion`` and
``create_responses``; when the wrapped coroutine raises or returns an
``ErrorResponse`` it calls ``notify_kv_transfer_request_rejected``, which
submits a pre-aborted one-token request straight to the engine core, whose
NIXL connector then notifies P exactly as a releaser would. Both directions
matter. A release the sidecar skips while D cannot send strands the blocks
until P's lease. A release both send reaches P twice per rank, and with D's
TP larger than P's, the sidecar's ``<id>:1`` landing between D's readers'
messages leaves the request held until the lease (P compares its count for
equality with the latest message's number; ``tests/conformance/
test_vllm_duplicates.py`` shows it with vLLM's own P code). So a rejection
counts as covered only when its status, ``error.type`` and route prove D
notifies, and everything else is released.

Evidence, read in the 0.21.0, 0.25.1, 0.29.0, 0.31.0, 0.33.0 and 0.34.0 wheels and
pinned row by row in ``tests/conformance/test_vllm_coverage_source.py``:

* The wrapper's body is the same in every release (``entrypoints/openai/
  engine/serving.py`` 0.21-0.24, ``entrypoints/generate/base/serving.py``
  0.25+); ``AsyncLLM.notify_kv_transfer_request_rejected`` too, except that
  0.33.0 adds ``watermarking=False`` to the request's sampling parameters.
  Model lookup (``_check_model``) and, from 0.29.0, the engine check and
  admission (``_preflight``) run inside the wrapped coroutines.
* Before the handler, in each route's ``api_router.py``: body validation
  answers 400 typed ``"Bad Request"`` (the HTTP phrase), other
  ``HTTPException``s their phrase, a server without the API 501
  ``"NotImplementedError"`` (the same body a handler's own
  ``NotImplementedError`` gets); auth and scaling middlewares answer
  ``{"error": ...}`` (no type).
* ``create_error_response`` gives handler errors ``"BadRequestError"`` (400),
  ``"NotFoundError"`` (404), ``"UnprocessableEntityError"`` (422, 0.25.0+),
  from 0.29.0 the phrase ``"Service Unavailable"`` for admission control (503,
  ``QueueOverflowError`` / ``MaxQueuedTokensError``; the notify bypasses
  admission), and from 0.33.0 ``"ServiceUnavailableError"`` (503) for a
  ``RetryableRequestError``.
* ``/v1/responses`` answers ``"invalid_request_error"`` (400, 404) from inside
  ``_create_responses`` only: prompt at or over ``max_model_len``
  (``_validate_generator_input``), ``_validate_create_responses_input``, an
  unknown ``previous_response_id`` (``_make_not_found_error``), and from 0.31.0
  the renderer's ``render_responses``. The same type elsewhere comes from other
  routes (retrieve/cancel a stored response, ``/v1/messages``, the render
  server), so the row is keyed by route.
* 0.33.0's paused engine (``/pause``, ``VLLM_SERVER_DEV_MODE``):
  ``EngineCore._reject_add_while_paused`` answers the request with a retryable
  error and re-adds it with ``abort_immediately``, so the engine core notifies
  P whatever the route, and the wrapper once more on the wrapped ones. The
  client sees 503 ``"ServiceUnavailableError"``, or as a stream the first
  event (cause ``stream_engine_paused``).

``/v1/messages`` is not wrapped itself, but its handler (``AnthropicServingMessages.
create_messages``, a subclass of the chat server in 0.20.0-0.34.0) converts the request and
then awaits the wrapped ``create_chat_completion``: an error of the chat handler is notified
by D, one of the conversion before it is not, and both reach the client the same way, in
Anthropic's shape (``{"type": "error", "error": {"type", "message"}}``, ``api_router.py``
``translate_error_response``) with vLLM's type before 0.33.0 (an exception: 500
``"internal_error"``) and Anthropic's name for the status from 0.33.0
(``translate_error_type``). Before 0.33.0 only an exception can come from the conversion, so
vLLM's other types there prove a notification; they are counted as "may be" all the same
(the release waits ``may_cover_delay`` and is sent: never stranded, never between D's
readers' messages). Every such answer may be covered
(``MESSAGES_ROWS``). The route's body validation answers before the handler, in OpenAI's
shape typed with the HTTP phrase: not covered. ``/inference/v1/generate``
(``ServingTokens.serve_tokens``) is not wrapped: never covered.

Answers that also come from where D cannot notify are not covered: 500
``"InternalServerError"`` is a dead engine's answer (the notify then fails)
and vLLM's catch-all exception handler's for any exception outside the
handler; 501 is also the router's. With D's engine alive, a wrapped handler
gives them too and D notifies: ``engine_may_cover`` names them, so the
release can be sent after D's own notification would have reached P, never
between D's readers' messages.

A request the sidecar gave up on after sending it (``header_timeout``, and
``client_gone_after_forward``: both release only with ``--release-ambiguous``
or in router mode) is covered too: the sidecar closes its connection, vLLM's
``with_cancellation`` cancels the handler, and the wrapper also fires when
the handler is cancelled. The one case left to P's lease: D accepted the
request but its handler never started.

Known gap: a non-streaming request whose ``X-data-parallel-rank`` is out of
range gets 400 ``"BadRequestError"`` from inside the handler, and D's notify
fails on the same rank; it is counted as covered. Only a misconfigured router
sends that header wrong, and then every request of it fails the same way.
"""

from __future__ import annotations

from typing import NamedTuple

from sidecar.classify import Cause
from sidecar.nixl.versions import WireProfile
from sidecar.release.base import ReleaseJob

Version = tuple[int, int, int]

FIX_SINCE: Version = (0, 21, 0)
#: The routes whose handlers the fix wraps (not the token-in/out route; /v1/messages calls the
#: wrapped chat handler after its own conversion: ``MESSAGES_ROWS``).
WRAPPED_ROUTES = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/responses"})
RESPONSES = frozenset({"/v1/responses"})
MESSAGES = frozenset({"/v1/messages"})
#: ``sidecar.classify.Cause`` values for "D answered with an error status".
D_ANSWERED = frozenset({Cause.REJECTED_4XX, Cause.REJECTED_5XX})
#: Causes for which the sidecar closed a connection on which D had the whole request and had
#: not answered: vLLM's ``with_cancellation`` cancels the handler, and the wrapper notifies P.
ABORTED_BY_SIDECAR = frozenset({Cause.HEADER_TIMEOUT, Cause.CLIENT_GONE_AFTER_FORWARD})
#: Stream causes (first SSE event) whose request D's engine core re-added to notify P, by release.
ENGINE_CORE_STREAMS: dict[Cause, Version] = {Cause.STREAM_ENGINE_PAUSED: (0, 33, 0)}


class Row(NamedTuple):
    """An answer D gives from where it notifies P: from ``since``, on ``routes`` (None: any)."""

    since: Version
    status: int
    error_type: str
    routes: frozenset[str] | None = WRAPPED_ROUTES


#: Answers that prove D notifies P itself.
COVERED: tuple[Row, ...] = (
    Row((0, 21, 0), 400, "BadRequestError"),
    Row((0, 21, 0), 404, "NotFoundError"),
    Row((0, 25, 0), 422, "UnprocessableEntityError"),
    Row((0, 29, 0), 503, "Service Unavailable"),
    Row((0, 21, 0), 400, "invalid_request_error", RESPONSES),
    Row((0, 21, 0), 404, "invalid_request_error", RESPONSES),
    Row((0, 33, 0), 503, "ServiceUnavailableError", None),  # the paused engine core re-adds it
)
#: ``/v1/messages``' handler errors: the chat handler's (notified) or the conversion's (not).
MESSAGES_ROWS: tuple[Row, ...] = tuple(
    Row(since, status, kind, MESSAGES)
    for since, pairs in (
        # vLLM's own types, in Anthropic's envelope (0.21.0-0.32.x)
        (
            (0, 21, 0),
            (
                (400, "BadRequestError"),
                (404, "NotFoundError"),
                (422, "UnprocessableEntityError"),
                (500, "InternalServerError"),
                (501, "NotImplementedError"),
                (503, "Service Unavailable"),
                (500, "internal_error"),  # an exception, of the conversion or through the wrapper
            ),
        ),
        # Anthropic's names for the status (0.33.0 ``translate_error_type``)
        (
            (0, 33, 0),
            (
                (400, "invalid_request_error"),
                (404, "not_found_error"),
                (422, "invalid_request_error"),
                (500, "api_error"),
                (501, "api_error"),
                (503, "overloaded_error"),
            ),
        ),
    )
    for status, kind in pairs
)
#: Answers D gives both where it notifies (a wrapped handler, engine alive) and where it cannot.
MAY_BE_COVERED: tuple[Row, ...] = (
    Row((0, 21, 0), 500, "InternalServerError"),
    Row((0, 21, 0), 501, "NotImplementedError"),
    *MESSAGES_ROWS,
)


def fix_version(text: str | None) -> Version | None:
    """The release to judge D's fix by: a known release's oldest possible code (a pre-release may
    be older than the release it leads to), the newest known behaviour for a newer release, None
    when unknown."""
    profile = WireProfile.for_version(text, "newest") if text else None
    return profile.low if profile is not None else None


def engine_covers(version: Version, job: ReleaseJob) -> bool:
    """True when D of ``version`` releases ``job`` itself, so the sidecar must not."""
    if version < FIX_SINCE or job.injected:
        return False
    route = job.route.split("?", 1)[0]
    if job.cause in ABORTED_BY_SIDECAR:
        return route in WRAPPED_ROUTES  # D's handler had the request and the sidecar's abort cancelled it
    if job.cause in ENGINE_CORE_STREAMS:
        return version >= ENGINE_CORE_STREAMS[job.cause]
    return _answered(COVERED, version, job, route)


def engine_may_cover(version: Version, job: ReleaseJob) -> bool:
    """True when D of ``version`` may or may not have released ``job``: its answer alone cannot
    tell. A release then must not reach P between D's readers' messages (send it after them)."""
    if version < FIX_SINCE or job.injected:
        return False
    route = job.route.split("?", 1)[0]
    if job.cause in ABORTED_BY_SIDECAR and route in MESSAGES:
        return True  # the abort cancelled the conversion (not notified) or the chat handler (notified)
    return _answered(MAY_BE_COVERED, version, job, route)


def _answered(rows: tuple[Row, ...], version: Version, job: ReleaseJob, route: str) -> bool:
    if job.cause not in D_ANSWERED or job.error_type is None:
        return False  # not D's answer: unreachable, the sidecar's own rejection, after-200 errors
    return any(
        version >= row.since
        and job.status == row.status
        and job.error_type == row.error_type
        and (row.routes is None or route in row.routes)
        for row in rows
    )
