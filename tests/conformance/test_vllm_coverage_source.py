"""Conformance: every row of the coverage table, pinned to the vLLM code it comes from.

``sidecar.decision.coverage`` decides from D's answer whether D's own fix
(vLLM 0.21.0+) already released a rejected request, and ``sidecar.classify``
tells two in-stream 503s apart by their text. Each row rests on a reading of
vLLM's serving code; these tests re-read it in the wheel of every release under
test (0.21.0, 0.25.1, 0.29.0, 0.31.0, 0.33.0 and 0.34.0 by default,
``KVR_CONFORMANCE_COVERAGE_VLLM``), so a release that moves a raise site
fails a test instead of a release. A row must hold from its first release on
and, where that is checkable, be absent before. The admission row is exact:
every 503 refusal of vLLM's admission must be one ``ADMISSION_REFUSALS``
names, so a new refusal with the same status and type fails here. The wheel is read with
``zipfile`` + ``ast`` (``tests/conformance/vllm_source.py``), never imported.
A missing wheel is downloaded; with no package index reachable the tests skip
with one line.
"""

from __future__ import annotations

import ast
import os
from collections.abc import Callable
from http import HTTPStatus

import pytest

from sidecar.classify import (
    ADMISSION_OVERFLOW_MESSAGES,
    ADMISSION_OVERFLOW_TYPE,
    ENGINE_FAULTED_MESSAGE,
    ENGINE_PAUSED_MESSAGE,
    validator_refusal,
)
from sidecar.decision.coverage import COVERED, ENGINE_CORE_STREAMS, MAY_BE_COVERED, WRAPPED_ROUTES, Row
from sidecar.nixl.versions import parse_version
from tests.conformance.vllm_facts import (
    HANDLERS,
    WRAPPED_HANDLERS,
    admission_refusals,
    error_mapping,
    mapped_type,
    reachable_answers,
    reaches,
    wrapped,
    wrapped_routes,
    wrapper_users,
)
from tests.conformance.vllm_source import (
    Source,
    answers,
    calls,
    first_line,
    handlers,
    wheel_or_skip,
)

VERSIONS = [
    v
    for v in os.environ.get(
        "KVR_CONFORMANCE_COVERAGE_VLLM", "0.21.0,0.25.1,0.29.0,0.31.0,0.33.0,0.34.0"
    ).split(",")
    if v
]
NIXL = "vllm/distributed/kv_transfer/kv_connector/v1/nixl/"
PREFIXES = (
    "vllm/entrypoints/",
    "vllm/renderers/",
    "vllm/v1/engine/",
    "vllm/exceptions.py",
    "vllm/outputs.py",
    NIXL,
)
Version = tuple[int, int, int]
Vllm = tuple[Version, Source]


@pytest.fixture(scope="module", params=VERSIONS)
def vllm(request: pytest.FixtureRequest) -> Vllm:
    parsed = parse_version(request.param)
    assert parsed is not None, request.param
    return parsed.release, Source(wheel_or_skip(request.param), PREFIXES)


# --- what the wheel says --------------------------------------------------------------------


def outside_answers_use_the_phrase(src: Source) -> None:
    """Body validation and HTTPExceptions, before any handler, are typed with the HTTP phrase."""
    assert "type=HTTPStatus.BAD_REQUEST.phrase" in ast.unparse(src.find("validation_exception_handler"))
    assert "type=HTTPStatus(exc.status_code).phrase" in ast.unparse(src.find("http_exception_handler"))


# --- the rows -------------------------------------------------------------------------------


def bad_request(version: Version, src: Source) -> None:
    """A handler's ValueError/VLLMValidationError (raised through the wrapper) or literal message."""
    assert mapped_type(src, "ValueError") == "'BadRequestError'"
    assert "err_type: str='BadRequestError'" in ast.unparse(error_mapping(src).args)
    assert ("BadRequestError", "BAD_REQUEST") in reachable_answers(src, "/v1/completions")
    outside_answers_use_the_phrase(src)


def not_found(version: Version, src: Source) -> None:
    """``_check_model`` answers an unknown model, first thing inside every wrapped coroutine."""
    check = src.find("_check_model", "engine/serving.py")
    assert ("NotFoundError", "NOT_FOUND") in answers(check)
    for route in WRAPPED_ROUTES:
        assert reaches(src, route, "_check_model"), route
    outside_answers_use_the_phrase(src)


def unprocessable(version: Version, src: Source) -> None:
    assert mapped_type(src, "VLLMUnprocessableEntityError") == "'UnprocessableEntityError'"


def no_unprocessable(version: Version, src: Source) -> None:
    assert "UnprocessableEntityError" not in ast.unparse(error_mapping(src))


def admission(version: Version, src: Source) -> None:
    """``_preflight`` -> ``check_admission`` inside every wrapped coroutine; the notify skips it."""
    assert mapped_type(src, "GracefulHTTPError") == "HTTPStatus(exc.http_status).phrase"
    # Exactly the refusals the sidecar knows: a new one (the same status and type, another
    # meaning) fails here, not in a user's cluster.
    refusals = admission_refusals(src)
    known = {name for name, (since, _) in ADMISSION_REFUSALS.items() if version >= since}
    assert set(refusals) == known, sorted(refusals)
    for name, message in refusals.items():
        assert message in ADMISSION_REFUSALS[name][1], name
    assert "check_admission" in calls(src.find("_preflight", "generate/base/serving.py"))
    for route in WRAPPED_ROUTES:
        assert reaches(src, route, "_preflight"), route
    assert "check_admission" not in calls(src.find("notify_kv_transfer_request_rejected", "async_llm.py"))


#: The queue limits, told apart from other 503s by their text (``sidecar.classify``).
OVERFLOWS = ("QueueOverflowError", "MaxQueuedTokensError")
#: Every 503 "Service Unavailable" refusal of vLLM's admission the sidecar knows, by exception: the
#: release it appears in and the messages the sidecar matches it by. ``admission`` holds each
#: release to exactly these.
ADMISSION_REFUSALS: dict[str, tuple[Version, frozenset[str]]] = {
    **{name: ((0, 29, 0), ADMISSION_OVERFLOW_MESSAGES) for name in OVERFLOWS},
    # fault tolerance: the engine core is faulted; D's own release waits in it (engine_faulted)
    "EngineFaultedError": ((0, 34, 0), frozenset({ENGINE_FAULTED_MESSAGE})),
}


def no_admission(version: Version, src: Source) -> None:
    assert not src.has("check_admission", "async_llm.py")


def responses_invalid_request(status: str) -> Callable[[Version, Source], None]:
    def check(version: Version, src: Source) -> None:
        """Raised inside ``_create_responses`` only; the type's other sites serve other routes."""
        assert ("invalid_request_error", status) in reachable_answers(src, "/v1/responses")
        inside = {node.name for node in wrapped(src, "/v1/responses")}
        expected = {"_validate_generator_input", "_validate_create_responses_input", "_make_not_found_error"}
        if version >= (0, 31, 0):
            expected.add("render_responses")
        assert expected <= inside
        for route in ("/v1/chat/completions", "/v1/completions"):
            assert "invalid_request_error" not in {t for t, _ in reachable_answers(src, route)}, route
        for path, name in src.sites('err_type="invalid_request_error"') + src.sites(
            "'invalid_request_error'"
        ):
            elsewhere = name in {"retrieve_responses", "cancel_responses"} or "/anthropic/" in path
            assert name in inside or elsewhere or "/scale_out/" in path, f"{path}: {name}"

    return check


def paused_engine(version: Version, src: Source) -> None:
    """0.33.0: the engine core answers a retryable error and re-adds the request to notify P."""
    assert "'ServiceUnavailableError' if isinstance(exc, RetryableRequestError)" in mapped_type(
        src, "GenerationError"
    )
    assert "RetryableRequestError" in ast.unparse(src.find("to_exception", "vllm/outputs.py"))
    paused = src.find("_reject_add_while_paused", "v1/engine/core.py")
    text = ast.unparse(paused)
    assert f"message={ENGINE_PAUSED_MESSAGE!r}" in text and "retryable=True" in text
    assert "request.abort_immediately = True" in text and "add_request" in calls(paused)
    handle = src.find("_handle_client_request", "v1/engine/core.py", cls="EngineCoreProc")
    assert first_line(handle, "_reject_add_while_paused") < first_line(handle, "add_request")
    retryable = {name for path, name in src.sites("retryable=True") if path.startswith("vllm/v1/engine/")}
    assert retryable <= {"_reject_add_while_paused", "process_outputs"}
    guards = [  # the output processor's retryable error is for pooling requests only
        ast.unparse(node.test)
        for node in ast.walk(src.find("process_outputs", "output_processor.py"))
        if isinstance(node, ast.If) and "retryable=True" in ast.unparse(node.body)
    ]
    assert guards and all("detokenizer is None" in guard for guard in guards)


def no_paused_engine(version: Version, src: Source) -> None:
    assert "RetryableRequestError" not in src.files["vllm/exceptions.py"]


def internal_error(version: Version, src: Source) -> None:
    """A wrapped handler's own 500, and vLLM's catch-all handler for any exception anywhere."""
    assert ("InternalServerError", "INTERNAL_SERVER_ERROR") in reachable_answers(src, "/v1/chat/completions")
    assert "err_type = 'InternalServerError'" in ast.unparse(error_mapping(src).body[-2:])
    assert any("app.exception_handler(Exception)" in text for text in src.files.values())


def not_implemented(version: Version, src: Source) -> None:
    """A handler's NotImplementedError, and the router's when the API is not served."""
    assert mapped_type(src, "NotImplementedError") == "'NotImplementedError'"
    for package, _ in HANDLERS.values():
        router = src.find(
            {"chat_completion": "create_chat_completion", "completion": "create_completion"}.get(
                package, "create_responses"
            ),
            f"openai/{package}/api_router.py",
        )
        assert first_line(router, "NotImplementedError") < first_line(router, router.name)


def messages_handler(version: Version, src: Source) -> None:
    """``/v1/messages`` converts the request, then awaits the wrapped chat handler (an error of
    either reaches the client in Anthropic's envelope): its handler errors may be notified."""
    cls = src.class_of("AnthropicServingMessages", "anthropic/serving.py")
    assert "OpenAIServingChat" in {ast.unparse(base) for base in cls.bases}
    create = src.find("create_messages", "anthropic/serving.py")
    convert = min(
        first_line(create, n) for n in ("to_chat_completion_request", "_convert_anthropic_to_openai_request")
    )
    assert convert < first_line(create, "create_chat_completion")
    assert not src.has("create_chat_completion", "anthropic/serving.py")  # the chat server's, wrapped
    build = ast.unparse(src.find("_build_base_request", "anthropic/serving.py"))
    assert "kv_transfer_params=anthropic_request.kv_transfer_params" in build
    route = ast.unparse(src.find("create_messages", "anthropic/api_router.py"))
    assert "translate_error_response(generator)" in route  # the chat handler's ErrorResponse
    # An exception (the conversion's, or one through the wrapper): 500 "internal_error" in some
    # releases (0.25.x), typed as create_error_response types it in others.
    caught = ("translate_error_response(create_error_response(e))", "type='internal_error'")
    assert any(text in route for text in caught)
    translated = ast.unparse(src.find("translate_error_response", "anthropic/api_router.py"))
    typed = "translate_error_type(response.error.code)" in translated
    assert typed == (version >= (0, 33, 0)), "Anthropic's type names from 0.33.0, vLLM's before"


def no_anthropic_type_names(version: Version, src: Source) -> None:
    assert not src.has("translate_error_type", "anthropic/protocol.py")


MESSAGES = frozenset({"/v1/messages"})
Evidence = tuple[Callable[[Version, Source], None], Callable[[Version, Source], None] | None]
EVIDENCE: dict[tuple[int, str, frozenset[str] | None], Evidence] = {
    (400, "BadRequestError", WRAPPED_ROUTES): (bad_request, None),
    (404, "NotFoundError", WRAPPED_ROUTES): (not_found, None),
    (422, "UnprocessableEntityError", WRAPPED_ROUTES): (unprocessable, no_unprocessable),
    (503, "Service Unavailable", WRAPPED_ROUTES): (admission, no_admission),
    (400, "invalid_request_error", frozenset({"/v1/responses"})): (
        responses_invalid_request("BAD_REQUEST"),
        None,
    ),
    (404, "invalid_request_error", frozenset({"/v1/responses"})): (
        responses_invalid_request("NOT_FOUND"),
        None,
    ),
    (503, "ServiceUnavailableError", None): (paused_engine, no_paused_engine),
    (500, "InternalServerError", WRAPPED_ROUTES): (internal_error, None),
    (501, "NotImplementedError", WRAPPED_ROUTES): (not_implemented, None),
    **{
        (row.status, row.error_type, MESSAGES): (
            messages_handler,
            no_anthropic_type_names if row.since >= (0, 33, 0) else None,
        )
        for row in MAY_BE_COVERED
        if row.routes == MESSAGES
    },
}
ROWS = [*COVERED, *MAY_BE_COVERED]


@pytest.mark.parametrize(
    "row", ROWS, ids=[f"{r.status} {r.error_type} {sorted(r.routes or ['any'])[0]}" for r in ROWS]
)
def test_each_row_is_where_the_table_says(vllm: Vllm, row: Row) -> None:
    version, src = vllm
    present, absent = EVIDENCE[(row.status, row.error_type, row.routes)]
    if version >= row.since:
        present(version, src)
    elif absent is not None:
        absent(version, src)


def test_the_fix_wraps_exactly_the_three_routes(vllm: Vllm) -> None:
    version, src = vllm
    wrapper = src.find("_with_kv_transfer_rejection_cleanup")
    assert "notify_kv_transfer_request_rejected" in calls(wrapper)
    assert wrapper_users(src) == WRAPPED_HANDLERS
    assert wrapped_routes(src) == WRAPPED_ROUTES
    notify = ast.unparse(src.find("notify_kv_transfer_request_rejected", "async_llm.py"))
    assert "abort_immediately=True" in notify
    assert ("watermarking=False" in notify) == (version >= (0, 33, 0))  # the one change since 0.21.0


def test_stream_admission_overflow_never_reaches_the_engine_core(vllm: Vllm) -> None:
    """0.29.0+: ``_add_request`` checks admission before handing the request to the engine core,
    and the refusal reaches a chat/completions stream as its first event, typed and worded so."""
    version, src = vllm
    if version < (0, 29, 0):
        assert not src.has("check_admission", "async_llm.py")
        return
    add = src.find("_add_request", "async_llm.py")
    assert first_line(add, "check_admission") < first_line(add, "add_request_async")
    refusals = admission_refusals(src)
    assert {refusals[name] for name in OVERFLOWS} == ADMISSION_OVERFLOW_MESSAGES
    assert HTTPStatus.SERVICE_UNAVAILABLE.phrase == ADMISSION_OVERFLOW_TYPE
    assert mapped_type(src, "GracefulHTTPError") == "HTTPStatus(exc.http_status).phrase"
    caught = handlers(src.find("generate", "async_llm.py"))
    assert isinstance(caught["GracefulHTTPError"].body[-1], ast.Raise)  # re-raised as is, not wrapped
    for package, generator in (
        ("chat_completion", "chat_completion_stream_generator"),
        ("completion", "completion_stream_generator"),
    ):
        stream = src.find(generator, f"openai/{package}/serving.py")
        assert calls(handlers(stream)["Exception"]) & {
            "create_streaming_error_response",
            "create_error_response",
        }


def test_stream_engine_paused_is_re_added_by_the_engine_core(vllm: Vllm) -> None:
    version, src = vllm
    since = ENGINE_CORE_STREAMS["stream_engine_paused"]
    if version < since:
        assert not src.has("_reject_add_while_paused")
        return
    paused_engine(version, src)
    assert isinstance(handlers(src.find("generate", "async_llm.py"))["GenerationError"].body[-1], ast.Raise)
    chat = src.find("chat_completion_stream_generator_raw", "chat_completion/serving.py")
    assert "err_type='InternalServerError', status_code=e.status_code" in ast.unparse(
        handlers(chat)["GenerationError"]
    )
    completion = src.find("completion_stream_generator", "completion/serving.py")
    assert "_convert_generation_error_to_streaming_response" in calls(handlers(completion)["GenerationError"])


def test_push_mode_rejection_sends_p_nothing(vllm: Vllm) -> None:
    """D's push scheduler queues an empty receive for a request aborted before it was scheduled,
    but nothing sends P a message for it: P frees its blocks at the lease."""
    version, src = vllm
    if not src.has("request_finished", "nixl/push_scheduler.py"):
        assert version < (0, 24, 0)  # push mode arrived in 0.24.0
        return
    finished = src.find("request_finished", "nixl/push_scheduler.py")
    branch = next(
        node
        for node in ast.walk(finished)
        if isinstance(node, ast.If) and ast.unparse(node.test) == "params.get('do_remote_prefill')"
    )
    assert "self._reqs_need_recv[request.request_id]" in ast.unparse(branch.body)
    staged = {
        name for path, name in src.sites("self._push_pending_registrations[") if "push_scheduler" in path
    }
    assert staged == {"update_state_after_alloc"}  # PUSH_REG: only once D has allocated blocks
    assert "send_notif" not in calls(src.find("start_load_kv", "nixl/push_worker.py"))
    senders = {(path.removeprefix(NIXL), name) for path, name in src.sites("send_notif(")}
    assert senders - {("pull_worker.py", "_read_blocks"), ("pull_worker.py", "_read_blocks_for_req")} <= {
        ("push_worker.py", "_do_send_reg_notif"),  # D: PUSH_REG
        ("push_worker.py", "_xfer_blocks_for_req"),  # P: "write done" to D (0.25.x)
        ("base_worker.py", "_send_heartbeats"),  # D: HB for requests its scheduler holds
        ("base_worker.py", "_send_pending_recv_notifs"),  # filled by pull reads only
    }
    fillers = {path for path, _ in src.sites("self._pending_recv_notifs.setdefault(")}
    assert fillers <= {NIXL + "pull_worker.py"}


#: The request models of the routes D's fix wraps: their pydantic validators run before the handler.
REQUEST_MODELS = ("ChatCompletionRequest", "CompletionRequest", "ResponsesRequest")


def validator_messages(src: Source) -> list[str]:
    """A sample of every message the request models' validators raise ``VLLMValidationError`` with
    (an f-string's values as "x"), from the wheel."""
    samples = []
    for tree in src.trees.values():
        for cls in (n for n in tree.body if isinstance(n, ast.ClassDef) and n.name in REQUEST_MODELS):
            for fn in (n for n in cls.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)):
                if not any("validator" in ast.unparse(d) for d in fn.decorator_list):
                    continue
                for sub in ast.walk(fn):
                    if (
                        isinstance(sub, ast.Raise)
                        and isinstance(sub.exc, ast.Call)
                        and ast.unparse(sub.exc.func).endswith("VLLMValidationError")
                        and sub.exc.args
                    ):
                        samples.append(_sample(sub.exc.args[0]))
    return samples


def _sample(node: ast.expr) -> str:
    if isinstance(node, ast.Constant):
        return str(node.value)
    assert isinstance(node, ast.JoinedStr), ast.unparse(node)
    return "".join(str(v.value) if isinstance(v, ast.Constant) else "x" for v in node.values)


def validation_error_is_a_value_error(src: Source) -> bool:
    """Whether pydantic turns ``VLLMValidationError`` into a validation error ("Bad Request")."""
    cls = src.class_of("VLLMValidationError", "vllm/exceptions.py")
    return any(ast.unparse(base) == "ValueError" for base in cls.bases)


def test_every_request_model_validator_refusal_is_told_apart(vllm: Vllm) -> None:
    """From 0.27.0 a validator's ``VLLMValidationError`` escapes pydantic and is answered 400
    "BadRequestError" before the handler (D never releases it): the sidecar knows each message."""
    version, src = vllm
    messages = validator_messages(src)
    assert messages, "no request model validator found"
    if validation_error_is_a_value_error(src):
        assert version < (0, 27, 0)  # answered "Bad Request" by the validation handler: released
        return
    assert version >= (0, 27, 0)
    unknown = [m for m in messages if not validator_refusal(f"{m} (parameter=p, value=v)")]
    assert unknown == [], unknown


#: Where vLLM's server writes a literal 503, and why none of them is a typed answer to a completion
#: request before its handler (``sidecar.sim.decode.rejections.pre_handler_rejection`` answers so).
OWN_503 = {
    "/elastic_ep/middleware.py": "elastic-EP scaling: {'error': ...}, no type",
    "/instrumentator/health.py": "GET /health",
    "/elastic_ep/api_router.py": "its own scaling routes",
    "/checkpoint/api_router.py": "its own checkpoint routes",
    "/dp_supervisor.py": "the data-parallel supervisor's health",
    "/anthropic/protocol.py": "Anthropic's name for the status (translate_error_type)",
}
LITERAL_503 = ("status_code=503", "HTTPStatus.SERVICE_UNAVAILABLE")


def test_the_only_503_before_a_completion_handler_is_scaling_and_untyped(vllm: Vllm) -> None:
    """A completion request is answered 503 before its handler only by the elastic-EP scaling
    middleware, with an untyped ``{"error": ...}`` body. A 503 typed ``"ServiceUnavailableError"``
    (``RetryableRequestError``, ``paused_engine``) or ``"Service Unavailable"`` (admission,
    ``admission``) comes from the handler: the simulator must never answer those before it."""
    _, src = vllm
    sites = {
        path
        for path, text in src.files.items()
        if path.startswith("vllm/entrypoints/") and any(literal in text for literal in LITERAL_503)
    }
    unexplained = {path for path in sites if not path.endswith(tuple(OWN_503))}
    assert unexplained == set()
    [middleware_path] = [path for path in sites if path.endswith("/elastic_ep/middleware.py")]
    middleware = src.trees[middleware_path]
    answers_503 = [
        node
        for node in ast.walk(middleware)
        if isinstance(node, ast.Call)
        and any(k.arg == "status_code" and ast.unparse(k.value) == "503" for k in node.keywords)
    ]
    assert answers_503
    for call in answers_503:
        [content] = [k.value for k in call.keywords if k.arg == "content"]
        assert isinstance(content, ast.Dict) and [ast.unparse(k) for k in content.keys if k] == ["'error'"]
