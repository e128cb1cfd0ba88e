"""Conformance: the signals ``sidecar.decode.state`` reads of D, pinned to vLLM's code.

Whether D's engine can notify P (alive, not shutting down, a KV connector) is
decided from ``/health``, a dead engine's answer text, ``Connection: close``
and the ``/metrics`` families of vLLM's NIXL connector. Each rests on a
reading of vLLM's code, re-read here in the wheel of every release under
test (0.21.0, 0.25.1, 0.29.0, 0.31.0, 0.33.0 and 0.34.0 by default,
``KVR_CONFORMANCE_DECODE_STATE_VLLM``; add 0.27.0,0.28.0 to see where vLLM
stopped closing its HTTP server at SIGTERM). Read with ``zipfile`` + ``ast``,
never imported; offline without the wheels the tests skip with one line.
"""

from __future__ import annotations

import ast

import pytest

from sidecar.decode.probes import NIXL_FAMILY, STATS_FAMILY
from sidecar.decode.state import ENGINE_DEAD_MESSAGES
from sidecar.sim.decode import engine as decode_engine
from tests.conformance.vllm_facts import error_mapping, mapped_type
from tests.conformance.vllm_source import Func, Source, calls, first_line, handlers, release_source, releases

VERSIONS = releases("KVR_CONFORMANCE_DECODE_STATE_VLLM")
PREFIXES = (
    "vllm/entrypoints/",
    "vllm/v1/engine/",
    "vllm/v1/metrics/",
    "vllm/distributed/kv_transfer/kv_connector/v1/",
)
Version = tuple[int, int, int]
Vllm = tuple[Version, Source]


@pytest.fixture(scope="module", params=VERSIONS)
def vllm(request: pytest.FixtureRequest) -> Vllm:
    return release_source(request.param, PREFIXES)


def nested(node: Func, name: str) -> Func:
    """The function ``name`` defined inside ``node``."""
    found = [
        n for n in ast.walk(node) if isinstance(n, ast.AsyncFunctionDef | ast.FunctionDef) and n.name == name
    ]
    assert len(found) == 1, f"{len(found)} defs of {name} in {node.name}"
    return found[0]


def assigned(node: ast.AST, name: str) -> str | None:
    """The string constant assigned to ``name`` anywhere in ``node``."""
    for sub in ast.walk(node):
        targets = sub.targets if isinstance(sub, ast.Assign) else []
        value = sub.value if isinstance(sub, ast.Assign) else None
        named = any(isinstance(t, ast.Name) and t.id == name for t in targets)
        if named and isinstance(value, ast.Constant) and isinstance(value.value, str):
            return value.value
    return None


def guarded(node: ast.AST, test: str, first: str) -> bool:
    """Whether ``node`` has ``if <test>:`` whose body starts with ``first`` (source text)."""
    return any(
        isinstance(sub, ast.If)
        and ast.unparse(sub.test) == test
        and ast.unparse(sub.body[0]).startswith(first)
        for sub in ast.walk(node)
    )


def line_of(node: Func, text: str) -> int:
    """The line of the first simple statement in ``node`` whose source contains ``text``."""
    simple = (ast.Expr, ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Return, ast.Raise)
    lines = [sub.lineno for sub in ast.walk(node) if isinstance(sub, simple) and text in ast.unparse(sub)]
    return min(lines, default=1 << 30)


# --- /health ----------------------------------------------------------------------------------


def test_health_is_503_exactly_when_the_engine_is_dead(vllm: Vllm) -> None:
    _, src = vllm
    health = src.find("health", "serve/instrumentator/health.py")
    caught = handlers(health)
    assert set(caught) == {"EngineDeadError"}
    assert "Response(status_code=503)" in ast.unparse(caught["EngineDeadError"])
    assert "check_health" in calls(health) and "Response(status_code=200)" in ast.unparse(health)
    assert guarded(
        src.find("check_health", "v1/engine/async_llm.py"), "self.errored", "raise self.dead_error"
    )
    errored = ast.unparse(src.find("errored", "v1/engine/async_llm.py"))
    assert "self.engine_core.resources.engine_dead or not self.is_running" in errored


# --- a dead engine's answer -------------------------------------------------------------------


def test_a_dead_engine_answers_500_with_a_text_only_it_gives(vllm: Vllm) -> None:
    version, src = vllm
    error = src.class_of("EngineDeadError", "v1/engine/exceptions.py")
    log_message, client_message = assigned(error, "ENGINE_DEAD_MESSAGE"), assigned(error, "CLIENT_MESSAGE")
    mapping = ast.unparse(error_mapping(src))
    if version >= (0, 33, 0):
        assert client_message == decode_engine.CLIENT_MESSAGE
        assert "message = exc.CLIENT_MESSAGE" in mapping
        seen = client_message
    else:
        assert client_message is None and "message = str(exc)" in mapping
        seen = log_message
    assert log_message == decode_engine.ENGINE_DEAD_MESSAGE
    assert seen in ENGINE_DEAD_MESSAGES
    bases = [ast.unparse(base) for base in error.bases if ast.unparse(base) != "Exception"]
    given = next((t for t in (mapped_type(src, n) for n in ("EngineDeadError", *bases)) if t), "")
    assert (given or fallback_type(src)) == "'InternalServerError'"
    for message in ENGINE_DEAD_MESSAGES:  # no other code answers with these texts
        holders = [path for path, text in src.files.items() if message in text]
        assert holders in ([], ["vllm/v1/engine/exceptions.py"]), holders


def fallback_type(src: Source) -> str:
    """The ``err_type`` of the mapping's final ``else`` (exceptions no branch names)."""
    for node in ast.walk(error_mapping(src)):
        if isinstance(node, ast.If) and node.orelse and not isinstance(node.orelse[0], ast.If):
            for stmt in node.orelse:
                if isinstance(stmt, ast.Assign) and ast.unparse(stmt.targets[0]) == "err_type":
                    return ast.unparse(stmt.value)
    return ""


def test_the_watchdog_stops_http_after_engine_death_unless_told_not_to(vllm: Vllm) -> None:
    _, src = vllm
    assert "VLLM_WATCHDOG_TIME_S = 5.0" in ast.unparse(src.find("watchdog_loop", "launcher.py"))
    terminate = ast.unparse(src.find("terminate_if_errored", "launcher.py"))
    assert "VLLM_KEEP_ALIVE_ON_ENGINE_DEATH" in terminate and "server.should_exit = True" in terminate


# --- shutdown ---------------------------------------------------------------------------------


def test_shutdown_drops_every_add_while_health_still_says_alive(vllm: Vllm) -> None:
    _, src = vllm
    reject = src.find("_reject_add_in_shutdown", "v1/engine/core.py")
    assert "abort_immediately" not in ast.unparse(reject)  # the notify is dropped like any request
    handle = src.find("_handle_client_request", "v1/engine/core.py", cls="EngineCoreProc")
    assert first_line(handle, "_reject_add_in_shutdown") < first_line(handle, "add_request")
    shutdown = src.find("shutdown", "v1/engine/core_client.py", cls="MPClient")
    assert line_of(shutdown, "engine_manager.shutdown(timeout=timeout)") < line_of(
        shutdown, "self.resources()"
    )
    cleanup = src.find("__call__", "v1/engine/core_client.py", cls="BackgroundResources")
    assert line_of(cleanup, "self.engine_dead = True") < 1 << 30


def test_sigterm_keeps_http_serving_from_0_28_and_closes_it_before(vllm: Vllm) -> None:
    version, src = vllm
    serve_http = src.find("serve_http", "launcher.py")
    handle = nested(serve_http, "handle_shutdown")
    assert line_of(handle, "engine_client.shutdown") < line_of(handle, "server.should_exit = True")
    if version >= decode_engine.NO_SIGNAL_SERVER:
        server = src.class_of("NoSignalServer", "launcher.py")
        capture = next(
            n for n in server.body if isinstance(n, ast.FunctionDef) and n.name == "capture_signals"
        )
        assert [ast.unparse(s) for s in capture.body] == ["yield"]
        assert "NoSignalServer(" in ast.unparse(serve_http)
    else:  # uvicorn's Server.capture_signals runs its own SIGTERM handler beside vLLM's
        assert not any("NoSignalServer" in text for text in src.files.values())
        assert "uvicorn.Server(config)" in ast.unparse(serve_http)


def test_vllm_never_sets_a_connection_header(vllm: Vllm) -> None:
    _, src = vllm
    for path, tree in src.trees.items():
        if path.startswith("vllm/entrypoints/"):
            texts = {
                n.value.lower()
                for n in ast.walk(tree)
                if isinstance(n, ast.Constant) and isinstance(n.value, str)
            }
            assert "connection" not in texts, path


# --- the KV connector -------------------------------------------------------------------------


def test_nixl_families_exist_exactly_with_a_nixl_connector_and_stats(vllm: Vllm) -> None:
    _, src = vllm
    sites = [
        name for path, name in src.sites("self.has_kv_connector = ") if path.startswith("vllm/entrypoints/")
    ]
    assert sites, "has_kv_connector is set nowhere"
    for path, name in src.sites("self.has_kv_connector = "):
        assert "self.has_kv_connector = kv_transfer_config is not None" in ast.unparse(src.find(name, path))
    prom = ast.unparse(src.find("__init__", "kv_connector/v1/metrics.py", cls="KVConnectorProm"))
    assert "if kv_transfer_config and kv_transfer_config.kv_connector:" in prom
    assert "build_prom_metrics" in prom
    built = [
        node
        for path, _, node in src.defs["build_prom_metrics"]
        if path.startswith("vllm/distributed/kv_transfer/kv_connector/v1/nixl/")
    ]
    assert len(built) == 1 and "NixlPromMetrics(" in ast.unparse(built[0])
    stats = ast.unparse(src.find("__init__", "nixl/stats.py", cls="NixlPromMetrics"))
    family = NIXL_FAMILY.decode()
    assert f"name='{family}xfer_time_seconds'" in stats and "create_metric_per_engine" in stats
    multi = ast.unparse(src.find("build_prom_metrics", "multi_connector.py"))
    assert "connector_cls.build_prom_metrics(" in multi  # a NIXL part's families too
    loggers = src.files["vllm/v1/metrics/loggers.py"]
    assert f'name="{STATS_FAMILY.decode()}"' in loggers
    init = src.find("__init__", "v1/engine/async_llm.py", cls="AsyncLLM")
    assert guarded(init, "self.log_stats", "self.logger_manager = StatLoggerManager(")
