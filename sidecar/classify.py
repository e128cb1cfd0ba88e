"""What a request's fate means for P's blocks: a pure function, tested with a table.

The proxy reports one ``Event`` per inspected request: D's status (and, for
a stream, the code of an error in its first SSE event), or the failure that
kept an answer from arriving. ``classify`` turns it into an ``Outcome`` and a
``Cause``. Only a definite pre-admission rejection releases: once D may have
admitted the request it may read P's blocks, and a release then lets P reuse
them under an in-flight READ (silently wrong output).

Gateway statuses (502, 504) never come from vLLM itself; they come from a
layer between us and D that may have delivered the request, so they are
ambiguous, like a timeout after sending.

A 200 stream whose first SSE event is an error failed when vLLM's engine
generator first ran, after the status was sent. A 4xx there is a rejection
before admission. A 5xx is ambiguous (D may have admitted the request and be
reading) except for two answers told apart by their exact text, both raised
before vLLM hands the request to its engine core's scheduler:

* 503 typed ``"Service Unavailable"`` with the message of ``QueueOverflowError``
  or ``MaxQueuedTokensError`` (vLLM 0.29.0+): the admission check
  ``AsyncLLM._add_request`` runs before ``engine_core.add_request_async``
  (``stream_admission_overflow``). D does not notify P (its handler returned
  a stream), so the sidecar releases.
* 503 with the message of 0.33.0's paused engine (``EngineCore.
  _reject_add_while_paused``; typed ``"InternalServerError"`` in a chat
  stream, ``"ServiceUnavailableError"`` in a completions stream): the engine
  core rejected it on arrival and re-adds it only to notify P
  (``stream_engine_paused``; ``sidecar.decision.coverage`` leaves it to D).

* 503 with the message of 0.34.0's ``EngineFaultedError`` (typed ``"Service
  Unavailable"``, or ``"overloaded_error"`` on ``/v1/messages``): with fault
  tolerance on, D's admission check refuses every request while its engine
  core is faulted (``stream_engine_faulted``). D's own notification then waits
  in the faulted engine core until it recovers, if ever, so it is released.

The same ``EngineFaultedError`` as a plain 503 answer before any body byte
(``engine_faulted``) has a cause of its own for the same reason: D's engine
does not release it in time. It is otherwise judged as any 503 (a proxy in
front that retries 503 gets it first: ``--retried-statuses``).

A ``/v1/completions`` body may hold several prompts, each its own engine
request admitted on its own; one can be refused after another was admitted.
vLLM's P/D does not serve such a body (P returns the first prompt's
``kv_transfer_params`` only), so the overflow answer is released on that
route too.

A 4xx/5xx status before any body byte is taken as a rejection before
admission. vLLM has a few answers that break that rule (docs/vllm-releases.md,
"Where the classification is not exact"): a non-streaming 500 for a request
that finished with an error, a pre-0.21.0 400 from output processing after
the request finished (both: D already read and notified, so the release only
repeats a done notification), and the 400 every in-flight request gets when
D's output handler dies (D's engine is then terminated).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum

import msgspec


@dataclass(frozen=True, slots=True)
class FirstEvent:
    """The first SSE event of a 200 stream, as ``sidecar.decision.sse`` scanned it."""

    error_code: int | None  # the error's code when the first event is an error
    error_type: str | None
    error_message: str | None = None


class Outcome(StrEnum):
    """What a decision means for P's blocks: the ``outcome`` label of ``kvr_not_released_total``."""

    RELEASE = "release"
    NO_RELEASE = "no_release"
    AMBIGUOUS = "ambiguous"  # D may have admitted it; released only if configured


class NoAnswer(StrEnum):
    """Why no answer from D reached the client: D's connection failed, the sidecar answered
    itself, or the client left: the ``failure`` of an ``Event`` and of an ``UpstreamError``. Its
    value is the ``failure`` field of the log line and the tracing span that report it, and router
    mode's ``kvr_leg_failures_total{cause}``."""

    # D's connection failed before the request was sent (all of them classify as ``unreachable``)
    CONNECT_REFUSED = "connect_refused"
    DNS = "dns"
    CONNECT_TIMEOUT = "connect_timeout"
    TLS_FAILED = "tls_failed"  # the TLS handshake with D failed: nothing was sent
    POOL_TIMEOUT = "pool_timeout"
    # D's connection failed after the request was sent: D may have it
    HEADER_TIMEOUT = "header_timeout"
    RESET_AFTER_SEND = "reset_after_send"
    # the sidecar answered itself
    BODY_TOO_LARGE = "body_too_large"
    SHUTTING_DOWN = "shutting_down"
    OVERLOADED = "overloaded"  # over the sidecar's own limit_concurrency
    INJECTED = "injected"
    PREFILL_ANSWER_TOO_LARGE = "prefill_answer_too_large"  # router mode: no decode leg was sent
    # the client left
    CLIENT_GONE_BEFORE_FORWARD = "client_gone_before_forward"
    CLIENT_GONE_AFTER_FORWARD = "client_gone_after_forward"


class Cause(StrEnum):
    """Why a decision is what it is: the ``cause`` label of the release metrics and logs.

    Where no answer from D arrived, the cause is the ``NoAnswer`` itself (the same value), except
    that D's connection failures before sending are all ``unreachable``; the other causes read
    D's answer.
    """

    # definite rejections: D never admitted the request
    REJECTED_4XX = "rejected_4xx"
    REJECTED_VALIDATION = (
        "rejected_validation"  # vLLM 0.27.0+: a request model's validator, before the handler
    )
    REJECTED_5XX = "rejected_5xx"
    UNREACHABLE = "unreachable"
    BODY_TOO_LARGE = NoAnswer.BODY_TOO_LARGE.value
    SHUTTING_DOWN = NoAnswer.SHUTTING_DOWN.value
    OVERLOADED = NoAnswer.OVERLOADED.value
    INJECTED = NoAnswer.INJECTED.value
    CLIENT_GONE_BEFORE_FORWARD = NoAnswer.CLIENT_GONE_BEFORE_FORWARD.value
    PREFILL_ANSWER_TOO_LARGE = NoAnswer.PREFILL_ANSWER_TOO_LARGE.value
    STREAM_ADMISSION_ERROR = "stream_admission_error"
    STREAM_ADMISSION_OVERFLOW = "stream_admission_overflow"  # vLLM 0.29.0+ queue limits
    STREAM_ENGINE_PAUSED = "stream_engine_paused"  # vLLM 0.33.0: D's engine core notifies P
    ENGINE_FAULTED = "engine_faulted"  # vLLM 0.34.0: not released by D's engine (it is faulted)
    STREAM_ENGINE_FAULTED = "stream_engine_faulted"  # the same, as a stream's first event
    # D admitted it (or will handle it itself)
    ADMITTED = "admitted"
    OTHER_STATUS = "other_status"
    # ambiguous: D may have received and admitted it
    HEADER_TIMEOUT = NoAnswer.HEADER_TIMEOUT.value
    RESET_AFTER_SEND = NoAnswer.RESET_AFTER_SEND.value
    GATEWAY_ERROR = "gateway_error"
    STREAM_ERROR_5XX = "stream_error_5xx"
    CLIENT_GONE_AFTER_FORWARD = NoAnswer.CLIENT_GONE_AFTER_FORWARD.value
    # router mode with decode_releases: the decode sidecar judged D's answer and releases it
    DELEGATED = "delegated"


#: The failures of D's connection (``sidecar.upstream`` reports them); the others are the
#: sidecar's own answers, and a client leaving.
D_FAILURES = frozenset(
    {
        NoAnswer.CONNECT_REFUSED,
        NoAnswer.DNS,
        NoAnswer.CONNECT_TIMEOUT,
        NoAnswer.TLS_FAILED,
        NoAnswer.POOL_TIMEOUT,
        NoAnswer.HEADER_TIMEOUT,
        NoAnswer.RESET_AFTER_SEND,
    }
)

#: The status the client sees when D produced no headers.
FAILURE_STATUS = {
    NoAnswer.CONNECT_REFUSED: 503,
    NoAnswer.DNS: 503,
    NoAnswer.CONNECT_TIMEOUT: 503,
    NoAnswer.TLS_FAILED: 503,
    NoAnswer.POOL_TIMEOUT: 503,
    NoAnswer.HEADER_TIMEOUT: 504,
    NoAnswer.RESET_AFTER_SEND: 502,
    NoAnswer.BODY_TOO_LARGE: 413,
    NoAnswer.SHUTTING_DOWN: 503,
    NoAnswer.OVERLOADED: 503,
    NoAnswer.PREFILL_ANSWER_TOO_LARGE: 502,
}


class Event(msgspec.Struct, frozen=True):
    """What happened to one request: everything the judge needs, in one value (a struct: one is
    made per request, in a tenth of a frozen dataclass's time).

    Exactly one of ``status`` / ``failure`` is set. ``first`` is a 200 stream's
    first SSE event; ``error_type`` and ``error_message`` are those of D's error
    answer; ``closing``: D's answer said ``Connection: close``; ``started``: the
    response to the client had started; ``answer``: the status the sidecar
    answered with itself, when it chose one (an injected rejection's);
    ``pending``: the head of a 200 stream whose first event decides later (the
    judge tells D's state what the head shows, at once, and decides nothing).
    """

    status: int | None = None
    stream: bool = False
    failure: NoAnswer | None = None
    first: FirstEvent | None = None
    error_type: str | None = None
    error_message: str | None = None
    closing: bool = False
    started: bool = False
    answer: int | None = None
    pending: bool = False


@dataclass(frozen=True, slots=True)
class Decision:
    outcome: Outcome
    cause: Cause

    def releases(self, release_ambiguous: bool) -> bool:
        return self.outcome is Outcome.RELEASE or (release_ambiguous and self.outcome is Outcome.AMBIGUOUS)


_NO_ANSWER: dict[NoAnswer, Decision] = {
    NoAnswer.CONNECT_REFUSED: Decision(Outcome.RELEASE, Cause.UNREACHABLE),
    NoAnswer.DNS: Decision(Outcome.RELEASE, Cause.UNREACHABLE),
    NoAnswer.CONNECT_TIMEOUT: Decision(Outcome.RELEASE, Cause.UNREACHABLE),
    NoAnswer.TLS_FAILED: Decision(Outcome.RELEASE, Cause.UNREACHABLE),
    NoAnswer.POOL_TIMEOUT: Decision(Outcome.RELEASE, Cause.UNREACHABLE),
    NoAnswer.BODY_TOO_LARGE: Decision(Outcome.RELEASE, Cause.BODY_TOO_LARGE),
    NoAnswer.SHUTTING_DOWN: Decision(Outcome.RELEASE, Cause.SHUTTING_DOWN),
    NoAnswer.OVERLOADED: Decision(Outcome.RELEASE, Cause.OVERLOADED),
    NoAnswer.INJECTED: Decision(Outcome.RELEASE, Cause.INJECTED),
    NoAnswer.CLIENT_GONE_BEFORE_FORWARD: Decision(Outcome.RELEASE, Cause.CLIENT_GONE_BEFORE_FORWARD),
    NoAnswer.PREFILL_ANSWER_TOO_LARGE: Decision(Outcome.RELEASE, Cause.PREFILL_ANSWER_TOO_LARGE),
    NoAnswer.HEADER_TIMEOUT: Decision(Outcome.AMBIGUOUS, Cause.HEADER_TIMEOUT),
    NoAnswer.RESET_AFTER_SEND: Decision(Outcome.AMBIGUOUS, Cause.RESET_AFTER_SEND),
    NoAnswer.CLIENT_GONE_AFTER_FORWARD: Decision(Outcome.AMBIGUOUS, Cause.CLIENT_GONE_AFTER_FORWARD),
}

_GATEWAY = frozenset({502, 504})

#: The messages of vLLM's ``QueueOverflowError`` and ``MaxQueuedTokensError`` (0.29.0-0.34.0,
#: ``vllm/exceptions.py``), answered with the type ``"Service Unavailable"``.
ADMISSION_OVERFLOW_TYPE = "Service Unavailable"
ADMISSION_OVERFLOW_MESSAGES = frozenset(
    {
        "The engine is currently busy and cannot accept new requests. "
        "Please try again later or on a different instance.",
        "The engine has reached its prefill token backlog limit. "
        "Please try again later or on a different instance.",
    }
)
#: What 0.33.0's ``EngineCore._reject_add_while_paused`` answers a request that came while paused.
ENGINE_PAUSED_MESSAGE = "Generation is paused. Please retry after it resumes."
_PAUSED_TYPES = frozenset({"InternalServerError", "ServiceUnavailableError"})  # chat, completions
#: vLLM 0.34.0's ``EngineFaultedError`` (``vllm/exceptions.py``), raised by ``AsyncLLM.
#: check_admission`` while fault tolerance is on and the engine core is not healthy.
ENGINE_FAULTED_MESSAGE = (
    "The engine has faulted and cannot accept new requests. "
    "Please try again later or on a different instance."
)
#: Its ``error.type``: the HTTP phrase (OpenAI routes), Anthropic's name for 503 (``/v1/messages``).
ENGINE_FAULTED_TYPES = frozenset({"Service Unavailable", "overloaded_error"})


#: The messages of the ``VLLMValidationError`` that vLLM's request models raise in their pydantic
#: validators (``ChatCompletionRequest``, ``CompletionRequest``, ``ResponsesRequest``; read in the
#: 0.29.0-0.34.0 wheels, pinned by ``tests/conformance/test_vllm_coverage_source.py``). From 0.27.0
#: ``VLLMValidationError`` is no ``ValueError``: pydantic lets it through, it leaves FastAPI's body
#: parsing before the handler runs, and vLLM's ``VLLMError`` handler answers 400 typed
#: ``"BadRequestError"``, the type a handler's own errors have, with `` (parameter=..., value=...)``
#: after the message. D's own release (the handler's wrapper) never sees it. Each entry is the
#: message's literal parts; vLLM puts values between them (an f-string).
VALIDATOR_MESSAGES: tuple[str, ...] = tuple(
    ".*".join(map(re.escape, parts))
    for parts in (
        ("Stream options can only be defined when `stream=True`.",),
        ("When response_format type is 'json_schema', the 'json_schema' field must be provided.",),
        ("You can only use one kind of constraints for structured outputs ('json', 'regex' or 'choice').",),
        ("You can only either use constraints for structured outputs or tools, not both.",),
        ("Cannot set both `continue_final_message` and `add_generation_prompt` to True.",),
        ("When using `tool_choice`, `tools` must be set.",),
        ("`tools` must not be an empty array. Either provide at least one tool or omit the field entirely.",),
        ("Invalid value for `tool_choice`: ", '! Only named tools, "none", "auto" or "required" are '
         "supported."),
        ("Invalid value for `function`: `", "` in `tool_choice`! ", ""),
        ("Expected field `name` in `function` in `tool_choice`! ", ""),
        ("Invalid `name` in `function`: `", "` in `tool_choice`! ", ""),
        ("The tool `", "` specified in `tool_choice` does not match any of the specified `tools`"),
        ("The tool specified in `tool_choice` does not match any of the specified `tools`",),
        ("`", "` must be an integer."),
        ("`logprob_token_ids` is not supported with beam search.",),
        ("when using `logprob_token_ids`, `logprobs` must be set to true.",),
        ("when using `logprob_token_ids`, `logprobs` must be set.",),
        ("when using `top_logprobs`, `logprobs` must be set to true.",),
        ("`prompt_logprobs` are not available when `stream=True`.",),
        ("`prompt_logprobs` must be a positive value or -1.",),
        ("`top_logprobs` must be a positive value or -1.",),
        ("`logprobs` must be a positive value or -1.",),
        (
            "`echo` with `logprobs` is not supported with beam search because beam search does not "
            "compute prompt logprobs.",
        ),
        (
            "`logprob_token_ids` is not supported when `echo=True` and `max_tokens=0` because no output "
            "tokens are generated.",
        ),
        ("Either prompt or prompt_embeds must be provided and non-empty.",),
        ("prompt list length ", " exceeds the maximum allowed count of ", ". To increase this limit, set "
         "the VLLM_MAX_COMPLETION_PROMPTS environment variable."),
        ("prompt_embeds list length ", " exceeds the maximum allowed count of ", ". To increase this "
         "limit, set the VLLM_MAX_COMPLETION_PROMPTS environment variable."),
        ("Custom tools with a grammar format are not supported; only free-form text custom tools are "
         "accepted.",),
        ("Tool choice 'function' not found in 'tools' parameter.",),
        ("Tool choice 'required' must be specified with 'tools' parameter.",),
        ("background can only be used when `store` is true",),
        ("prompt template is not supported",),
    )
)  # fmt: skip
_VALIDATOR = re.compile(
    "(?:" + "|".join(VALIDATOR_MESSAGES) + r")(?: \((?:parameter|value)=.*\))?", re.DOTALL
)


def validator_refusal(message: str | None) -> bool:
    """Whether ``message`` is one of ``VALIDATOR_MESSAGES`` (with vLLM's parameter suffix)."""
    return message is not None and _VALIDATOR.fullmatch(message) is not None


# Router mode holds P's parameters and closes its connection to D in these cases,
# which aborts D's request: no live request reads the blocks any more.
ROUTER_RELEASES = frozenset({Cause.HEADER_TIMEOUT, Cause.CLIENT_GONE_AFTER_FORWARD})


def classify(event: Event) -> Decision:
    """The outcome of one inspected request (see the module docstring)."""
    if event.failure is not None:
        return _NO_ANSWER[event.failure]
    status = event.status or 0
    if 200 <= status < 300:
        return _classify_admitted(event)
    if status in _GATEWAY:
        return Decision(Outcome.AMBIGUOUS, Cause.GATEWAY_ERROR)
    if 400 <= status < 500:
        if status == 400 and event.error_type == "BadRequestError" and validator_refusal(event.error_message):
            return Decision(Outcome.RELEASE, Cause.REJECTED_VALIDATION)
        return Decision(Outcome.RELEASE, Cause.REJECTED_4XX)
    if 500 <= status < 600:
        if _faulted(status, event.error_type, event.error_message):
            return Decision(Outcome.RELEASE, Cause.ENGINE_FAULTED)
        return Decision(Outcome.RELEASE, Cause.REJECTED_5XX)
    # 1xx/3xx: vLLM sends neither; not a rejection we can vouch for.
    return Decision(Outcome.NO_RELEASE, Cause.OTHER_STATUS)


def stream_event(first: FirstEvent) -> Event:
    """The event of a 200 stream whose first SSE event was scanned (its response started)."""
    return Event(status=200, stream=True, first=first, started=True)


def _classify_admitted(event: Event) -> Decision:
    first = event.first
    if not event.stream or first is None or first.error_code is None:
        return Decision(Outcome.NO_RELEASE, Cause.ADMITTED)
    code = first.error_code
    if 400 <= code < 500:
        # vLLM's engine refused the request after the 200 went out: the stream's first event is
        # the error (the engine's admission of the request failed; nothing was read from P).
        return Decision(Outcome.RELEASE, Cause.STREAM_ADMISSION_ERROR)
    if code == 503 and first.error_message is not None:
        if first.error_type == ADMISSION_OVERFLOW_TYPE and first.error_message in ADMISSION_OVERFLOW_MESSAGES:
            return Decision(Outcome.RELEASE, Cause.STREAM_ADMISSION_OVERFLOW)
        if first.error_message == ENGINE_PAUSED_MESSAGE and first.error_type in _PAUSED_TYPES:
            return Decision(Outcome.RELEASE, Cause.STREAM_ENGINE_PAUSED)
        if _faulted(code, first.error_type, first.error_message):
            return Decision(Outcome.RELEASE, Cause.STREAM_ENGINE_FAULTED)
    return Decision(Outcome.AMBIGUOUS, Cause.STREAM_ERROR_5XX)


def _faulted(status: int, error_type: str | None, message: str | None) -> bool:
    """Whether an answer is vLLM's ``EngineFaultedError`` (exact status, type and message)."""
    return status == 503 and message == ENGINE_FAULTED_MESSAGE and error_type in ENGINE_FAULTED_TYPES
