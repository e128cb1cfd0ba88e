"""Conformance: what the vLLM plugin relies on is in vLLM's own source, release by release.

The wheel of each release under test is downloaded (``pip download --no-deps``)
into the cache of ``tests.conformance.wheels``
(``$KVR_VLLM_WHEEL_DIR`` or ``~/.cache/kv-release-sidecar/vllm``) and read with
``zipfile`` + ``ast``; vLLM is never imported. Checked: the ``EngineClient``
methods and signatures the plugin calls, ``AsyncLLM``'s abort-on-cancel,
``notify_kv_transfer_request_rejected`` (0.21.0+), ``app.state.engine_client``,
how ``--middleware`` mounts a class, ``SamplingParams.extra_args`` carrying
``kv_transfer_params``, the NIXL connector's release of a request aborted before
scheduling, that ``--api-key`` does not guard the route, and the
``EndpointPlugin`` protocol (0.26.0+). Then vLLM's own wiring code
(``load_endpoint_plugins`` + ``attach_endpoint_plugins`` + plugin state, and the
``--middleware`` loop) is compiled out of the wheel with stub globals and run on
a real FastAPI app: vLLM's code finds this project's installed entry point and
the route answers. A failed download fails the test; only a wheel that is not
cached while no package index answers is skipped (one line).
"""

from __future__ import annotations
import __future__ as future

import ast
import importlib
import inspect
import logging
import os
import sys
import types
import zipfile
from argparse import Namespace
from collections.abc import Callable
from functools import cache
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from sidecar.vllm_plugin import HEALTH_PATH, RELEASE_PATH, KVReleasePlugin
from tests.conformance.wheels import fetch_wheel
from tests.support.fake_engine import LegacyEngine, NotifyEngine

VERSIONS = [
    v
    for v in os.environ.get(
        "KVR_CONFORMANCE_PLUGIN_VLLM", "0.34.0,0.33.0,0.26.0,0.21.0,0.20.0,0.11.0,0.9.2"
    ).split(",")
    if v
]
TOKEN = "conformance-token-0123456789"
PARAMS = {
    "do_remote_prefill": True,
    "remote_engine_id": "p",
    "remote_request_id": "r-p",
    "remote_block_ids": [1],
}
Version = tuple[int, ...]
Func = ast.FunctionDef | ast.AsyncFunctionDef


class Source:
    """The Python files of one vLLM wheel, parsed lazily."""

    def __init__(self, version: str) -> None:
        self.version: Version = tuple(int(p) for p in version.split("."))
        with zipfile.ZipFile(fetch_wheel(version)) as archive:
            self.files = {n: archive.read(n).decode() for n in archive.namelist() if n.endswith(".py")}
        self._trees: dict[str, ast.Module] = {}

    def tree(self, path: str) -> ast.Module:
        if path not in self._trees:
            self._trees[path] = ast.parse(self.files[path])
        return self._trees[path]

    def under(self, prefix: str) -> list[str]:
        return [n for n in self.files if n.startswith(prefix)]

    def cls(self, path: str, name: str) -> ast.ClassDef:
        found = [n for n in self.tree(path).body if isinstance(n, ast.ClassDef) and n.name == name]
        assert found, f"vLLM {self.version}: no class {name} in {path}"
        return found[0]

    def functions(self, paths: list[str], name: str) -> list[tuple[str, Func]]:
        return [
            (path, node)
            for path in paths
            for node in ast.walk(self.tree(path))
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == name
        ]


def method(cls: ast.ClassDef, name: str) -> Func | None:
    found = [n for n in cls.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) and n.name == name]
    return found[0] if found else None


def positional(func: Func) -> list[str]:
    return [a.arg for a in func.args.posonlyargs + func.args.args]


def accepts(func: Func, name: str) -> bool:
    return name in positional(func) + [a.arg for a in func.args.kwonlyargs]


@cache
def source_of(version: str) -> Source:
    return Source(version)


@pytest.fixture(scope="module", params=VERSIONS)
def src(request: pytest.FixtureRequest) -> Source:
    return source_of(request.param)


# --- the engine client ------------------------------------------------------------------------


def test_engine_client_generate_and_abort(src: Source) -> None:
    client = src.cls("vllm/engine/protocol.py", "EngineClient")
    generate, abort = method(client, "generate"), method(client, "abort")
    assert generate is not None and abort is not None
    assert positional(generate)[:4] == ["self", "prompt", "sampling_params", "request_id"]
    assert isinstance(abort, ast.AsyncFunctionDef) and positional(abort)[:2] == ["self", "request_id"]


def test_async_llm_generate_takes_the_rank_and_aborts_when_cancelled(src: Source) -> None:
    """The emulation's guarantees: a rank keyword, and cancelling the stream aborts the request."""
    llm = src.cls("vllm/v1/engine/async_llm.py", "AsyncLLM")
    generate = method(llm, "generate")
    assert isinstance(generate, ast.AsyncFunctionDef) and accepts(generate, "data_parallel_rank")
    assert any(isinstance(n, ast.Yield) for n in ast.walk(generate)), "generate() is an async generator"
    handlers = [n for n in ast.walk(generate) if isinstance(n, ast.ExceptHandler) and n.type is not None]
    cancel = [h for h in handlers if h.type is not None and "CancelledError" in ast.unparse(h.type)]
    assert cancel and any(".abort(" in ast.unparse(stmt) for h in cancel for stmt in h.body)


def test_notify_kv_transfer_request_rejected(src: Source) -> None:
    client = src.cls("vllm/engine/protocol.py", "EngineClient")
    llm = src.cls("vllm/v1/engine/async_llm.py", "AsyncLLM")
    declared, implemented = (
        method(client, "notify_kv_transfer_request_rejected"),
        method(llm, "notify_kv_transfer_request_rejected"),
    )
    if src.version < (0, 21, 0):
        assert declared is None and implemented is None  # the plugin emulates it there
        return
    for func in (declared, implemented):
        assert isinstance(func, ast.AsyncFunctionDef)
        assert positional(func) == ["self", "request_id", "kv_transfer_params"]
        assert [a.arg for a in func.args.kwonlyargs] == ["data_parallel_rank"]
    body = ast.unparse(implemented)  # type: ignore[arg-type]
    assert "abort_immediately=True" in body and "'kv_transfer_params'" in body


def test_engine_client_is_on_app_state(src: Source) -> None:
    found = src.functions(src.under("vllm/entrypoints/"), "init_app_state")
    assert found
    for _, func in found:
        assigns = [ast.unparse(n) for n in ast.walk(func) if isinstance(n, ast.Assign)]
        assert "state.engine_client = engine_client" in assigns


def test_sampling_params_carry_kv_transfer_params(src: Source) -> None:
    params = src.cls("vllm/sampling_params.py", "SamplingParams")
    fields = {
        n.target.id for n in params.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
    }
    assert {"max_tokens", "extra_args"} <= fields
    assert (
        'extra_args.get("kv_transfer_params")'
        in src.files["vllm/v1/request.py"].replace("\n", "").replace("get(                    ", "get(")
        or "extra_args.get(" in src.files["vllm/v1/request.py"]
    )


def test_connector_releases_a_request_aborted_before_scheduling(src: Source) -> None:
    """D's NIXL connector queues an empty receive (then notifies P) for such a request (0.9.2+)."""
    files = src.under("vllm/distributed/kv_transfer/kv_connector/v1/nixl")
    hits = []
    for _, func in src.functions(files, "request_finished"):
        for branch in (
            n for n in ast.walk(func) if isinstance(n, ast.If) and "do_remote_prefill" in ast.unparse(n.test)
        ):
            for stmt in branch.body:
                if isinstance(stmt, ast.Assign) and "_reqs_need_recv" in ast.unparse(stmt.targets[0]):
                    value = stmt.value
                    assert isinstance(value, ast.Tuple) and isinstance(value.elts[1], ast.List)
                    hits.append(value.elts[1].elts)
    assert hits and all(elts == [] for elts in hits)


def test_api_key_does_not_guard_the_route(src: Source) -> None:
    prefixes: list[str] = []
    for path in src.under("vllm/entrypoints/"):
        if '"Unauthorized"' not in src.files[path]:
            continue
        for node in ast.walk(src.tree(path)):
            if isinstance(node, ast.Assign) and ast.unparse(node.targets[0]) == "GUARDED_PREFIX":
                prefixes += ast.literal_eval(node.value)
            if isinstance(node, ast.Call) and ast.unparse(node.func).endswith(".startswith") and node.args:
                arg = node.args[0]
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                    prefixes.append(arg.value)
    assert "/v1" in prefixes
    assert not [p for p in prefixes if RELEASE_PATH.startswith(p) or HEALTH_PATH.startswith(p)]


# --- the two extension points ----------------------------------------------------------------


def middleware_loop(src: Source) -> ast.For:
    loops = [
        node
        for path in src.under("vllm/entrypoints/")
        if "args.middleware" in src.files[path]
        for node in ast.walk(src.tree(path))
        if isinstance(node, ast.For) and ast.unparse(node.iter) == "args.middleware"
    ]
    assert len(loops) == 1, f"vLLM {src.version}: {len(loops)} --middleware loops"
    return loops[0]


def test_middleware_flag_mounts_a_class_with_add_middleware(src: Source) -> None:
    calls = [ast.unparse(n) for n in ast.walk(middleware_loop(src)) if isinstance(n, ast.Call)]
    assert "app.add_middleware(imported)" in calls  # built by Starlette with the next app only
    assert "inspect.isclass(imported)" in calls


def compiled(nodes: list[ast.stmt], namespace: dict[str, Any]) -> dict[str, Any]:
    """Run vLLM's statements in ``namespace`` (annotations stay strings: no vLLM type is needed)."""
    module = ast.fix_missing_locations(ast.Module(body=nodes, type_ignores=[]))
    exec(
        compile(module, "<vllm wheel>", "exec", flags=future.annotations.compiler_flag, dont_inherit=True),
        namespace,
    )
    return namespace


async def test_vllm_middleware_loop_mounts_the_middleware(
    src: Source, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVR_CONTROL_TOKEN", TOKEN)
    monkeypatch.delenv("KVR_CONTROL_TOKEN_FILE", raising=False)
    mount = ast.parse("def mount(app, args):\n    pass").body[0]
    assert isinstance(mount, ast.FunctionDef)
    mount.body = [middleware_loop(src)]  # vLLM's loop, as it stands in build_app
    namespace = compiled([mount], {"importlib": importlib, "inspect": inspect})
    app = FastAPI()
    namespace["mount"](app, Namespace(middleware=["sidecar.vllm_plugin.KVReleaseMiddleware"]))
    engine = NotifyEngine() if src.version >= (0, 21, 0) else LegacyEngine()
    app.state.engine_client = engine
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://d") as client:
        health = await client.get(HEALTH_PATH, headers={"authorization": f"Bearer {TOKEN}"})
        denied = await client.post(RELEASE_PATH, json={"request_id": "r", "kv_transfer_params": PARAMS})
    assert health.status_code == 200
    assert health.json()["action"] == ("notify" if src.version >= (0, 21, 0) else "emulate")
    assert denied.status_code == 401


def test_endpoint_plugin_protocol(src: Source) -> None:
    path = "vllm/plugins/endpoint_plugins/interface.py"
    if src.version < (0, 26, 0):
        assert path not in src.files  # before 0.26.0 only the middleware form exists
        return
    protocol = src.cls(path, "EndpointPlugin")
    fields = {
        n.target.id for n in protocol.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
    }
    assert fields == {"name", "required_tasks"}
    for name, is_async in (("attach_router", False), ("init_state", True)):
        theirs = method(protocol, name)
        assert theirs is not None and isinstance(theirs, ast.AsyncFunctionDef) is is_async
        ours = getattr(KVReleasePlugin, name)
        assert inspect.iscoroutinefunction(ours) is is_async
        assert positional(theirs) == list(inspect.signature(ours).parameters)
    groups = {
        ast.unparse(n.targets[0]): ast.literal_eval(n.value)
        for n in src.tree("vllm/plugins/__init__.py").body
        if isinstance(n, ast.Assign) and isinstance(n.value, ast.Constant)
    }
    assert groups["ENDPOINT_PLUGINS_GROUP"] == "vllm.endpoint_plugins"
    tasks = src.files["vllm/tasks.py"]
    assert '"generate"' in tasks  # KVReleasePlugin.required_tasks names a real task


def vllm_plugin_loader(src: Source, allowed: list[str] | None) -> dict[str, Any]:
    """vLLM's discovery, gating, attach and state code, compiled out of the wheel."""
    plugins = src.tree("vllm/plugins/__init__.py")
    wanted = {"load_plugins_by_group", "load_endpoint_plugins"}
    nodes: list[ast.stmt] = [
        n
        for n in plugins.body
        if (isinstance(n, ast.FunctionDef) and n.name in wanted)
        or (isinstance(n, ast.Assign) and isinstance(n.value, ast.Constant))
    ]
    attach = {"attach_endpoint_plugins", "_attach_endpoint_plugins"}
    state = {"init_endpoint_plugins_state", "_init_endpoint_plugins_state"}
    for path in ("vllm/plugins/endpoint_plugins/interface.py", "vllm/entrypoints/openai/api_server.py"):
        if path in src.files:
            nodes += [
                n
                for n in src.tree(path).body
                if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) and n.name in attach | state
            ]
    from copy import copy

    from fastapi.routing import APIRoute
    from starlette.routing import BaseRoute

    namespace = compiled(
        nodes,
        {
            "envs": types.SimpleNamespace(VLLM_PLUGINS=allowed),
            "Any": Any,
            "Callable": Callable,
            "logger": logging.getLogger("vllm-wheel"),
            "copy": copy,
            "APIRoute": APIRoute,
            "BaseRoute": BaseRoute,
        },
    )
    namespace["attach"] = next(namespace[n] for n in attach if n in namespace)
    namespace["init_state"] = next(namespace[n] for n in state if n in namespace)
    return namespace


PLUGIN_VERSIONS = [v for v in VERSIONS if tuple(int(p) for p in v.split(".")) >= (0, 26, 0)]


@pytest.mark.parametrize("version", PLUGIN_VERSIONS)
@pytest.mark.parametrize(
    ("allowed", "tasks", "loaded"),
    [
        (["kv_release"], ("generate",), True),
        (["other", "kv_release"], ("generate", "render"), True),
        (None, ("generate",), False),  # VLLM_PLUGINS unset: endpoint plugins are never loaded
        (["other"], ("generate",), False),
        (["kv_release"], ("embed",), False),  # a pooling server cannot release
    ],
)
async def test_vllm_loads_the_plugin_from_its_entry_point(
    version: str,
    monkeypatch: pytest.MonkeyPatch,
    allowed: list[str] | None,
    tasks: tuple[str, ...],
    loaded: bool,
) -> None:
    src = source_of(version)  # 0.26.0+ only: before, the middleware form is the way in
    monkeypatch.setenv("KVR_CONTROL_TOKEN", TOKEN)
    monkeypatch.delenv("KVR_CONTROL_TOKEN_FILE", raising=False)
    vllm = vllm_plugin_loader(src, allowed)
    stub = types.ModuleType("vllm.plugins")
    stub.load_endpoint_plugins = vllm["load_endpoint_plugins"]  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))
    monkeypatch.setitem(sys.modules, "vllm.plugins", stub)  # attach does "from vllm.plugins import ..."
    app = FastAPI()
    vllm["attach"](app, tasks)
    engine = NotifyEngine()
    app.state.engine_client = engine
    await vllm["init_state"](engine, app.state, Namespace())
    body = {"request_id": "r", "kv_transfer_params": PARAMS}
    headers = {"authorization": f"Bearer {TOKEN}"}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://d") as client:
        response = await client.post(RELEASE_PATH, json=body, headers=headers)
    assert [type(p) for p in app.state.endpoint_plugins] == ([KVReleasePlugin] if loaded else [])
    assert response.status_code == (202 if loaded else 404)
    assert engine.notified == ([("r", PARAMS, None)] if loaded else [])
