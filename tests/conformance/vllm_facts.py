"""What the sidecar depends on in a vLLM release, read out of its wheel as named facts (text).

One place for the readings that both the conformance tests and the release-day
lane (``tests/conformance/release_day.py``) make: the NIXL side channel
(connector version, ``NixlAgentMetadata`` / ``NixlHandshakePayload`` fields,
the listener's request and reply frames), P's notification handling (how it
parses ``<id>:<n>``, when it frees, what it does with an id it does not hold,
the lease default), the serving layer's errors (``vllm/exceptions.py``,
``create_error_response``'s mapping, the answers each wrapped route can
build, what the admission check raises, which routes D's own fix wraps) and
the plugin's contract (the entry-point group, the ``EndpointPlugin``
protocol, the abort path). The wheel is read with ``zipfile`` + ``ast``
(``tests.conformance.vllm_source.Source``), never imported.

``extract`` maps each fact's name to its value as text; a fact the wheel does
not hold is ``"absent"`` and one the reading could not make sense of is
``"unreadable: ..."``, so a release that moves code shows up as a difference
instead of a crash.
"""

from __future__ import annotations

import ast
import functools
import re
from collections.abc import Callable, Iterator
from http import HTTPStatus
from pathlib import Path

from tests.conformance.vllm_source import FUNCS, Func, Source, answers, calls, raised

NIXL = "vllm/distributed/kv_transfer/kv_connector/v1/nixl"  # nixl_connector.py before 0.20.0, nixl/ after
PREFIXES = (
    "vllm/entrypoints/",
    "vllm/renderers/",
    "vllm/v1/engine/",
    "vllm/exceptions.py",
    "vllm/outputs.py",
    "vllm/engine/protocol.py",
    "vllm/plugins/",
    NIXL,
)
# Where a wrapped handler's calls may lead: its serving code, the shared bases, the renderer.
SERVING = (
    "vllm/entrypoints/openai/",
    "vllm/entrypoints/serve/engine/",
    "vllm/entrypoints/generate/",
    "vllm/entrypoints/utils.py",
    "vllm/renderers/",
)
# route -> (serving package, the coroutine D's fix wraps)
HANDLERS = {
    "/v1/chat/completions": ("chat_completion", "_create_chat_completion"),
    "/v1/completions": ("completion", "_create_completion"),
    "/v1/responses": ("responses", "_create_responses"),
}
SCALE_OUT = ("vllm/entrypoints/scale_out/",)  # the token-in/token-out server of /inference/v1/generate
WRAPPED_HANDLERS = frozenset({"create_chat_completion", "create_completion", "create_responses"})
ABSENT = "absent"
SEP = "; "  # between the items of a fact's value (an annotation may hold ", ")
Facts = dict[str, str]


@functools.cache
def wheel_facts(wheel: Path) -> Facts:
    """Every fact of the wheel at ``wheel`` (read once per process)."""
    return extract(Source(wheel, PREFIXES))


def extract(src: Source) -> Facts:
    """Every fact of ``src`` (a ``Source`` over at least ``PREFIXES``), by name."""
    facts: Facts = {}
    for reader in READERS:
        try:
            facts.update(reader(src))
        except (AssertionError, LookupError, StopIteration, ValueError, AttributeError) as exc:
            facts[reader.__name__.removeprefix("_") + " (all)"] = f"unreadable: {exc!r}"[:200]
    return facts


# --- the serving layer (shared with test_vllm_coverage_source.py) ---------------------------


def error_mapping(src: Source) -> Func:
    """vLLM's module-level ``create_error_response``: how an exception becomes (type, status)."""
    found = [
        node
        for _, cls, node in src.defs["create_error_response"]
        if cls is None and "isinstance(exc," in ast.unparse(node)
    ]
    assert len(found) == 1, f"{len(found)} create_error_response with an exception mapping"
    return found[0]


def mapping_branches(src: Source) -> Iterator[tuple[list[str], ast.If]]:
    """(exception names, branch) of every ``isinstance(exc, ...)`` test in ``create_error_response``."""
    for node in ast.walk(error_mapping(src)):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Call) and len(node.test.args) == 2:
            if ast.unparse(node.test.args[0]) != "exc":
                continue
            caught = node.test.args[1]
            names = caught.elts if isinstance(caught, ast.Tuple) else [caught]
            yield [ast.unparse(n) for n in names], node


def assigned_in(branch: ast.If, target: str) -> str:
    """The source of what ``branch``'s own body assigns to ``target`` ('' if nothing)."""
    return next(
        (
            ast.unparse(s.value)
            for s in branch.body
            if isinstance(s, ast.Assign) and ast.unparse(s.targets[0]) == target
        ),
        "",
    )


def mapped_type(src: Source, exception: str) -> str:
    """The source of the ``err_type`` create_error_response gives ``exception`` ('' if none)."""
    for names, branch in mapping_branches(src):
        if exception in names:
            return assigned_in(branch, "err_type")
    return ""


@functools.cache
def wrapped(src: Source, route: str) -> list[Func]:
    """The coroutine the fix wraps for ``route`` and every def it may call."""
    package, name = HANDLERS[route]
    start = src.find(name, f"openai/{package}/serving.py")
    return [start, *src.reach(start, SERVING).values()]


def reachable_answers(src: Source, route: str) -> set[tuple[str, str]]:
    """(type, HTTPStatus name) of every literal error answer ``route``'s wrapped handler may build."""
    return set().union(*(answers(node) for node in wrapped(src, route)))


def reaches(src: Source, route: str, name: str) -> bool:
    """Whether ``route``'s wrapped handler may call ``name``."""
    return any(name in calls(node) for node in wrapped(src, route))


def wrapper_users(src: Source) -> set[str]:
    """The defs that use D's fix, ``_with_kv_transfer_rejection_cleanup`` (besides itself)."""
    return {
        name
        for name, entries in src.defs.items()
        for _, _, node in entries
        if "_with_kv" in ast.unparse(node)
    } - {"_with_kv_transfer_rejection_cleanup"}


def wrapped_routes(src: Source) -> set[str]:
    """The paths whose api_router handlers call a handler D's fix wraps."""
    routes = set()
    for package, _ in HANDLERS.values():
        tree = src.trees.get(f"vllm/entrypoints/openai/{package}/api_router.py")
        for node in ast.walk(tree) if tree is not None else ():
            if isinstance(node, ast.AsyncFunctionDef) and calls(node) & WRAPPED_HANDLERS:
                routes |= {
                    str(d.args[0].value)
                    for d in node.decorator_list
                    if isinstance(d, ast.Call) and d.args and isinstance(d.args[0], ast.Constant)
                }
    return routes


def exception_message(src: Source, name: str) -> str:
    """The message a ``vllm/exceptions.py`` class passes to its base."""
    message = _passed_message(src.class_of(name, "vllm/exceptions.py"))
    assert message is not None, f"{name} passes no literal message"
    return message


def admission_refusals(src: Source) -> dict[str, str]:
    """Every 503 typed "Service Unavailable" vLLM's admission can answer, by exception: what
    ``check_admission`` raises and every ``GracefulHTTPError`` of ``vllm/exceptions.py`` with that
    status (a new one fails the exact checks before it can reach a client unknown), with its message."""
    names = raised(src.find("check_admission", "async_llm.py"))
    tree = src.trees["vllm/exceptions.py"]
    names |= {
        cls.name
        for cls in tree.body
        if isinstance(cls, ast.ClassDef)
        and "GracefulHTTPError" in {ast.unparse(b) for b in cls.bases}
        and "HTTPStatus.SERVICE_UNAVAILABLE" in ast.unparse(cls)
    }
    return {name: exception_message(src, name) for name in names}


def _passed_message(cls: ast.ClassDef) -> str | None:
    init = next((n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"), None)
    for node in ast.walk(init) if init is not None else ():
        if isinstance(node, ast.Call) and ast.unparse(node.func) == "super().__init__" and node.args:
            first = node.args[0]
            return str(first.value) if isinstance(first, ast.Constant) else None
    return None


# --- the facts, one reader per part the sidecar depends on ----------------------------------


def _classes(src: Source, name: str, path: str) -> list[ast.ClassDef]:
    return [
        node
        for where, tree in src.trees.items()
        if path in where
        for node in tree.body
        if isinstance(node, ast.ClassDef) and node.name == name
    ]


def _fields(cls: ast.ClassDef) -> list[str]:
    return [
        f"{n.target.id}: {ast.unparse(n.annotation)}"
        for n in cls.body
        if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
    ]


def _constant(src: Source, name: str, path: str) -> str:
    for where, tree in src.trees.items():
        for node in tree.body if path in where else ():
            if isinstance(node, ast.Assign):
                targets, value = node.targets, node.value
            elif isinstance(node, ast.AnnAssign) and node.value is not None:
                targets, value = [node.target], node.value
            else:
                continue
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                return ast.unparse(value)
    return ABSENT


def _handshake(src: Source) -> Facts:
    facts = {"nixl: NIXL_CONNECTOR_VERSION": _constant(src, "NIXL_CONNECTOR_VERSION", NIXL)}
    facts["nixl: GET_META_MSG"] = _constant(src, "GET_META_MSG", NIXL)
    for name in ("NixlAgentMetadata", "NixlHandshakePayload"):
        found = _classes(src, name, NIXL)
        cls = found[0] if found else None
        kind = ABSENT
        if cls is not None:
            shape = [ast.unparse(d) for d in cls.decorator_list]
            shape += [ast.unparse(b) for b in cls.bases] + [ast.unparse(k) for k in cls.keywords]
            kind = SEP.join(shape) or "plain class"
        facts[f"nixl: {name} kind"] = kind
        fields = _fields(cls) if cls is not None else []
        facts[f"nixl: {name} fields"] = SEP.join(fields) or ABSENT
    read = [f for f in facts["nixl: NixlAgentMetadata fields"].split(SEP) if f.startswith(READ_FIELDS)]
    facts["nixl: NixlAgentMetadata fields the releaser reads"] = SEP.join(read) or ABSENT
    return facts


#: The ``NixlAgentMetadata`` fields the releaser decodes (``sidecar.nixl.messages.AgentMetadataView``).
READ_FIELDS = ("engine_id:", "agent_metadata:")


def _pull_method(src: Source, name: str, kind: str) -> Func | None:
    """``name`` as the pull-side ``kind`` (Worker/Scheduler) class defines it: not push, not abstract."""
    found = [
        (owner is not None and "Pull" in owner, node)
        for path, owner, node in src.defs[name]
        if NIXL in path and owner is not None and kind in owner and "Push" not in owner
        if not _abstract(node)
    ]
    found.sort(key=lambda item: item[0], reverse=True)
    return found[0][1] if found else None


def _abstract(node: Func) -> bool:
    body = [n for n in node.body if not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))]
    return len(body) == 1 and isinstance(body[0], ast.Raise)


def _side_channel(src: Source) -> Facts:
    listener = _pull_method(src, "_nixl_handshake_listener", "Scheduler")
    where = "scheduler (one per engine)"
    if listener is None:
        listener, where = _pull_method(src, "_nixl_handshake_listener", "Worker"), "worker (one per TP rank)"
    if listener is None:
        return {"nixl: side-channel listener": ABSENT}
    request = "raw bytes"
    for node in ast.walk(listener):
        if isinstance(node, ast.Assign) and "decode" in calls(node.value):
            request = "[" + ast.unparse(node.targets[0]).strip("()") + "] = " + ast.unparse(node.value)
    frames = [
        ast.unparse(element)
        for node in ast.walk(listener)
        if isinstance(node, ast.Call) and "send_multipart" in calls(node) and node.args
        for element in getattr(node.args[0], "elts", [node.args[0]])
    ]
    replies = [f for f in frames if f not in ("identity", "b''")]
    return {
        "nixl: side-channel listener": where,
        "nixl: side-channel request": request,
        "nixl: side-channel reply frames": SEP.join(replies) if replies else "unreadable",
    }


def _statements(body: list[ast.stmt]) -> str:
    """What a block does, one word or call per statement: ``logger.error(); continue``."""
    done = []
    for stmt in body:
        if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call):
            done.append(ast.unparse(stmt.value.func) + "()")
        elif isinstance(stmt, ast.Raise):
            done.append("raise " + (ast.unparse(stmt.exc) if stmt.exc is not None else ""))
        else:
            done.append(type(stmt).__name__.lower())
    return SEP.join(done)


SPLITS = frozenset({"rsplit", "split", "partition", "rpartition"})


def _notifications(src: Source) -> Facts:
    handler = _pull_method(src, "_get_new_notifs", "Worker")
    if handler is None:
        return {"notify: P's notification handler": ABSENT}
    parse = free = heartbeat = unknown = ABSENT
    for node in ast.walk(handler):
        if isinstance(node, ast.Assign) and calls(node.value) & SPLITS:
            parse = parse if parse != ABSENT else ast.unparse(node)
        if isinstance(node, ast.If):
            test = ast.unparse(node.test)
            if "startswith(" in test and heartbeat == ABSENT:
                heartbeat = test
            if "not in self._reqs_to_send" in test and unknown == ABSENT:
                unknown = _statements(node.body)
            if "==" in test and "consumer" in test and free == ABSENT:
                free = test
    return {
        "notify: parse of '<id>:<n>'": parse,
        "notify: P frees when": free,
        "notify: heartbeat test": heartbeat,
        "notify: P's answer to an id it does not hold": unknown,
    }


def _lease(src: Source) -> Facts:
    defaults = {
        ast.unparse(node.args[1])
        for tree in (t for path, t in src.trees.items() if NIXL in path)
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and "get_from_extra_config" in calls(node)
        and len(node.args) == 2
        and ast.unparse(node.args[0]) == "'kv_lease_duration'"
    }
    return {"notify: kv_lease_duration default": SEP.join(sorted(defaults)) or ABSENT}


def _exceptions(src: Source) -> Facts:
    tree = src.trees.get("vllm/exceptions.py")
    facts = {}
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)) if tree is not None else ():
        statuses = sorted(
            {
                node.attr
                for node in ast.walk(cls)
                if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                if node.value.id == "HTTPStatus"
            }
        )
        message = _passed_message(cls)
        value = SEP.join(ast.unparse(b) for b in cls.bases)
        value += "".join(f"{SEP}{_status(s)}" for s in statuses)
        value += f"{SEP}{message!r}" if message is not None else ""
        facts[f"errors: exception {cls.name}"] = value
    return facts


def _status(name: str) -> str:
    return str(HTTPStatus[name].value) if name in HTTPStatus.__members__ else name


def _mapping(src: Source) -> Facts:
    facts = {}
    for names, branch in mapping_branches(src):
        kind, status = assigned_in(branch, "err_type"), assigned_in(branch, "status_code")
        status = _status(status.removeprefix("HTTPStatus.")) if status.startswith("HTTPStatus.") else status
        facts[f"errors: create_error_response({', '.join(names)})"] = f"{kind} {status}".strip()
    return facts


def _answers(src: Source) -> Facts:
    facts = {}
    for route in HANDLERS:
        found = sorted((_status(status), kind) for kind, status in reachable_answers(src, route))
        facts[f"errors: literal answers in {route}"] = SEP.join(f"{s} {k}" for s, k in found)
    admission = [n for path, _, n in src.defs["check_admission"] if path.endswith("async_llm.py")]
    facts["errors: admission check raises"] = SEP.join(sorted(raised(admission[0]))) if admission else ABSENT
    return facts


def _other_routes(src: Source) -> Facts:
    """The two inspected routes D's fix does not wrap itself: ``/v1/messages`` (its handler awaits
    the wrapped chat handler; errors in Anthropic's envelope) and ``/inference/v1/generate``."""
    messages = [n for path, _, n in src.defs["create_messages"] if path.endswith("anthropic/serving.py")]
    by_status = _constant(src, "_ANTHROPIC_ERROR_TYPE_BY_STATUS", "anthropic/protocol.py")
    tokens = [n for path, _, n in src.defs["serve_tokens"] if "/scale_out/" in path]
    found = (
        set().union(*(answers(n) for n in [*tokens, *src.reach(tokens[0], SCALE_OUT).values()]))
        if tokens
        else None
    )
    return {
        "errors: /v1/messages awaits the wrapped chat handler": (
            str("create_chat_completion" in calls(messages[0])) if messages else ABSENT
        ),
        "errors: /v1/messages Anthropic type by status": re.sub(
            r"HTTPStatus\.(\w+)\.value", lambda m: _status(m[1]), by_status
        ),
        "errors: literal answers in /inference/v1/generate": (
            SEP.join(f"{s} {k}" for s, k in sorted((_status(st), k) for k, st in found))
            if found is not None
            else ABSENT
        ),
    }


def _fix(src: Source) -> Facts:
    wrapper = src.defs.get("_with_kv_transfer_rejection_cleanup")
    notify = [n for path, c, n in src.defs["notify_kv_transfer_request_rejected"] if c == "AsyncLLM"]
    return {
        "fix: wrapper calls notify_kv_transfer_request_rejected": (
            str("notify_kv_transfer_request_rejected" in calls(wrapper[0][2])) if wrapper else ABSENT
        ),
        "fix: defs using the wrapper": SEP.join(sorted(wrapper_users(src))) or ABSENT,
        "fix: wrapped routes": SEP.join(sorted(wrapped_routes(src))) or ABSENT,
        "fix: AsyncLLM.notify_kv_transfer_request_rejected": (
            f"({ast.unparse(notify[0].args)}); abort_immediately=True: "
            f"{'abort_immediately=True' in ast.unparse(notify[0])}"
            if notify
            else ABSENT
        ),
    }


def _plugin(src: Source) -> Facts:
    group = _constant(src, "ENDPOINT_PLUGINS_GROUP", "vllm/plugins/__init__.py")
    facts = {"plugin: ENDPOINT_PLUGINS_GROUP": group}
    found = _classes(src, "EndpointPlugin", "vllm/plugins/")
    protocol = ABSENT
    if found:
        members = _fields(found[0]) + [
            f"{'async ' if isinstance(n, ast.AsyncFunctionDef) else ''}{n.name}({ast.unparse(n.args)})"
            for n in found[0].body
            if isinstance(n, FUNCS)
        ]
        protocol = SEP.join(members)
    facts["plugin: EndpointPlugin protocol"] = protocol
    return facts


def _abort(src: Source) -> Facts:
    add = [n for path, c, n in src.defs["add_request"] if path.endswith("core.py") and c == "EngineCore"]
    branch = ABSENT
    for node in ast.walk(add[0]) if add else ():
        if isinstance(node, ast.If) and "abort_immediately" in ast.unparse(node.test):
            branch = f"if {ast.unparse(node.test)}: {_statements(node.body)}"
    generate = [n for _, c, n in src.defs["generate"] if c == "AsyncLLM"]
    caught = [
        handler
        for handler in (ast.walk(generate[0]) if generate else ())
        if isinstance(handler, ast.ExceptHandler) and handler.type is not None
        if "CancelledError" in ast.unparse(handler.type)
    ]
    cancelled = any("abort" in calls(handler) for handler in caught)
    return {
        "abort: EngineCore.add_request": branch,
        "abort: AsyncLLM.generate aborts when cancelled": str(cancelled),
    }


READERS: tuple[Callable[[Source], Facts], ...] = (
    _handshake,
    _side_channel,
    _notifications,
    _lease,
    _exceptions,
    _mapping,
    _answers,
    _other_routes,
    _fix,
    _plugin,
    _abort,
)
