"""Whether D's own fix (vLLM 0.21.0+) already releases a rejected request: a pure function.

From 0.21.0, ``_with_kv_transfer_rejection_cleanup`` wraps exactly three
handlers, ``create_chat_completion``, ``create_completion`` and
``create_responses``; when the wrapped coroutine raises or returns an
``ErrorResponse`` it calls ``notify_kv_transfer_request_rejected``, which
submits a pre-aborted one-token request straight to the engine core, whose
NIXL connector then notifies P exactly as a releaser would (reference 5). A
second release of the same request only makes P log an error, but a missed
one strands the blocks until P's lease expires, so a rejection counts as
covered only when its status and ``error.type`` prove it came from inside a
wrapped handler *and* D's notify can still work. Everything else is released.

Evidence, read in every wheel 0.21.0-0.33.0 (0.22.1, 0.25.1, 0.27.1 included):

* The wrapper and ``AsyncLLM.notify_kv_transfer_request_rejected`` are
  byte-identical in body across the span (``entrypoints/openai/engine/serving.py``
  0.21-0.24, ``entrypoints/generate/base/serving.py`` 0.25+;
  ``v1/engine/async_llm.py``). The public ``create_*`` methods of
  ``entrypoints/openai/{chat_completion,completion,responses}/serving.py`` only
  call the wrapper; model lookup (``_check_model``), engine health and, from
  0.29.0, admission (``_preflight`` -> ``check_admission``) run inside it.
* Before the handler, in ``entrypoints/openai/*/api_router.py``: the
  ``validate_json_request`` dependency and body validation raise
  ``RequestValidationError`` -> 400 with type ``"Bad Request"`` (the HTTP phrase;
  ``validation_exception_handler`` in ``entrypoints/openai/server_utils.py``,
  later ``entrypoints/serve/exception_handling/handlers/validation.py``); a
  server without the API raises ``NotImplementedError`` -> 501
  ``"NotImplementedError"``, the same body a handler's own
  ``NotImplementedError`` gets, so 501 is never covered. Auth (401) and
  elastic-EP scaling (503) middlewares answer ``{"error": "..."}``
  (``error_type`` None); unknown paths get FastAPI's ``{"detail": ...}``.
* ``create_error_response`` (``entrypoints/utils.py`` 0.21-0.22,
  ``entrypoints/serve/utils/error_response.py`` 0.23-0.27,
  ``entrypoints/serve/exception_handling/error_response.py`` 0.28+) gives
  handler errors ``"BadRequestError"`` (400), ``"NotFoundError"`` (404),
  ``"UnprocessableEntityError"`` (422, from 0.25.0), ``"NotImplementedError"``
  (501), ``"InternalServerError"`` (500), and from 0.29.0 a
  ``GracefulHTTPError`` (admission: ``QueueOverflowError``,
  ``MaxQueuedTokensError`` in ``vllm/exceptions.py``) its phrase,
  ``"Service Unavailable"`` (503). The notify bypasses admission, so a 503
  from admission is covered.
* 500 ``"InternalServerError"`` is not covered: it is what a dead engine gives
  (the handler raises ``engine_client.dead_error``), and then the notify fails
  too (it is only logged: "Failed to notify KV connector").

A request the sidecar gave up on after sending it (``header_timeout``, and
``client_gone_after_forward``: both release only with ``--release-ambiguous``
or in router mode) is covered too: the sidecar closes its connection, vLLM's
``with_cancellation`` cancels the handler, and the wrapper "also fires when
the handler is cancelled" (reference 5). Releasing it as well would reach P
twice per rank (an "unrecognized request" error on P each time), and, if D had
admitted the request and was reading, the sidecar's notification could free
blocks under that read; D's own abort path waits for its read. The one case
left to P's lease: D accepted the request but its handler never started.

Known gap: a non-streaming request whose ``X-data-parallel-rank`` is out of
range gets 400 ``"BadRequestError"`` from inside the handler, and D's notify
fails on the same rank; it is counted as covered. Only a misconfigured router
sends that header wrong, and then every request of it fails the same way.
"""

from __future__ import annotations

from sidecar.release.base import ReleaseJob

Version = tuple[int, int, int]

FIX_SINCE: Version = (0, 21, 0)
#: The routes whose handlers the fix wraps (not /v1/messages, not the token-in/out route).
WRAPPED_ROUTES = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/responses"})
#: ``sidecar.classify.Cause`` values for "D answered with an error status".
D_ANSWERED = frozenset({"rejected_4xx", "rejected_5xx"})
#: Causes for which the sidecar closed a connection on which D had the whole request and had
#: not answered: vLLM's ``with_cancellation`` cancels the handler, and the wrapper notifies P.
ABORTED_BY_SIDECAR = frozenset({"header_timeout", "client_gone_after_forward"})
#: (first release, status, error.type) of answers that only a wrapped handler gives.
IN_HANDLER: tuple[tuple[Version, int, str], ...] = (
    ((0, 21, 0), 400, "BadRequestError"),
    ((0, 21, 0), 404, "NotFoundError"),
    ((0, 25, 0), 422, "UnprocessableEntityError"),
    ((0, 29, 0), 503, "Service Unavailable"),
)


def engine_covers(version: Version, job: ReleaseJob) -> bool:
    """True when D of ``version`` releases ``job`` itself, so the sidecar must not."""
    if version < FIX_SINCE or job.injected or job.route.split("?", 1)[0] not in WRAPPED_ROUTES:
        return False
    if job.cause in ABORTED_BY_SIDECAR:
        return True  # D's handler had the request and the sidecar's abort cancelled it
    if job.cause not in D_ANSWERED or job.error_type is None:
        return False  # not D's answer: unreachable, the sidecar's own rejection, after-200 errors
    return any(
        version >= since and job.status == status and job.error_type == type_
        for since, status, type_ in IN_HANDLER
    )
