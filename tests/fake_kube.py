"""A fake Kubernetes API server: the list and watch JSON the real API serves, for two resources.

Serves ``GET /api/v1/namespaces/{ns}/pods`` and
``GET /apis/inference.networking.k8s.io/v1/namespaces/{ns}/inferencepools``: a
list (``{"kind": "PodList", "metadata": {"resourceVersion"}, "items"}``), or with
``watch=true`` a stream of newline-delimited ``{"type": "ADDED"|"MODIFIED"|"DELETED",
"object": {...}}`` events after ``resourceVersion``, as the API documents them
("Efficient detection of changes", the watch event shape of ``WatchEvent``). Label
selectors (``a=b,c=d``) and the ``metadata.name`` field selector are honoured. Every
request must carry ``Authorization: Bearer <token>`` (401 with a ``Status`` otherwise).
Tests change the objects with ``put`` and ``delete``; each change bumps the resource
version and reaches open watches at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

GROUP_PATH = "/apis/inference.networking.k8s.io/v1/namespaces/{namespace}/inferencepools"
KINDS = {"pods": ("v1", "Pod"), "inferencepools": ("inference.networking.k8s.io/v1", "InferencePool")}


def pod(name: str, ip: str, labels: dict[str, str], phase: str = "Running") -> dict[str, Any]:
    return {
        "metadata": {"name": name, "namespace": "llm", "labels": labels},
        "spec": {"containers": [{"name": "vllm", "image": "vllm"}]},
        "status": {"phase": phase, "podIP": ip, "podIPs": [{"ip": ip}]},
    }


def inference_pool(name: str, selector: dict[str, str], ports: list[int]) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "namespace": "llm"},
        "spec": {
            "selector": {"matchLabels": selector},
            "targetPorts": [{"number": p} for p in ports],
            "endpointPickerRef": {"name": "epp", "port": {"number": 9002}},
        },
    }


class FakeKube:
    """The objects, their resource versions and the open watches."""

    def __init__(self, token: str) -> None:
        self.token = token
        self.version = 1
        self.objects: dict[str, dict[str, dict[str, Any]]] = {"pods": {}, "inferencepools": {}}
        self.watchers: list[tuple[str, asyncio.Queue[dict[str, Any]]]] = []
        self.requests: list[str] = []
        self.loop: asyncio.AbstractEventLoop | None = None

    def put(self, resource: str, obj: dict[str, Any]) -> None:
        """Create or replace (thread-safe: runs on the server's loop)."""
        self._call(self._change, resource, obj, False)

    def delete(self, resource: str, name: str) -> None:
        self._call(self._change, resource, {"metadata": {"name": name}}, True)

    def _call(self, fn: Any, *args: Any) -> None:
        if self.loop is None:
            fn(*args)
        else:
            self.loop.call_soon_threadsafe(fn, *args)

    def _change(self, resource: str, obj: dict[str, Any], deleted: bool) -> None:
        self.version += 1
        name = obj["metadata"]["name"]
        store = self.objects[resource]
        kind = "DELETED" if deleted else ("MODIFIED" if name in store else "ADDED")
        obj = store.pop(name, obj) if deleted else obj
        api_version, kind_name = KINDS[resource]
        obj = {**obj, "apiVersion": api_version, "kind": kind_name}
        obj["metadata"] = {**obj["metadata"], "resourceVersion": str(self.version)}
        if not deleted:
            store[name] = obj
        for watched, queue in self.watchers:
            if watched == resource:
                queue.put_nowait({"type": kind, "object": obj})

    def app(self) -> Starlette:
        async def pods(request: Request) -> Response:
            return await self._serve(request, "pods")

        async def pools(request: Request) -> Response:
            return await self._serve(request, "inferencepools")

        @contextlib.asynccontextmanager
        async def lifespan(app: Starlette) -> AsyncIterator[None]:
            self.loop = asyncio.get_running_loop()
            yield

        routes = [Route("/api/v1/namespaces/{namespace}/pods", pods), Route(GROUP_PATH, pools)]
        return Starlette(routes=routes, lifespan=lifespan)

    async def _serve(self, request: Request, resource: str) -> Response:
        self.requests.append(str(request.url))
        if request.headers.get("authorization") != f"Bearer {self.token}":
            status = {
                "kind": "Status",
                "apiVersion": "v1",
                "status": "Failure",
                "reason": "Unauthorized",
                "code": 401,
            }
            return JSONResponse(status, status_code=401)
        match = _matcher(request.query_params.get("labelSelector"), request.query_params.get("fieldSelector"))
        items = [o for o in self.objects[resource].values() if match(o)]
        if request.query_params.get("watch") not in ("true", "1"):
            api_version, kind = KINDS[resource]
            body = {
                "apiVersion": api_version,
                "kind": f"{kind}List",
                "metadata": {"resourceVersion": str(self.version)},
            }
            return JSONResponse({**body, "items": items})
        queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        entry = (resource, queue)
        self.watchers.append(entry)

        async def events() -> AsyncIterator[bytes]:
            try:
                while True:
                    event = await queue.get()
                    if match(event["object"]) or event["type"] == "DELETED":
                        yield json.dumps(event).encode() + b"\n"
            finally:
                self.watchers.remove(entry)

        return StreamingResponse(events(), media_type="application/json")


def _matcher(labels: str | None, fields: str | None) -> Any:
    wanted = dict(part.split("=", 1) for part in (labels or "").split(",") if "=" in part)
    name = dict(part.split("=", 1) for part in (fields or "").split(",") if "=" in part).get("metadata.name")

    def match(obj: dict[str, Any]) -> bool:
        meta = obj.get("metadata", {})
        have = meta.get("labels") or {}
        return all(have.get(k) == v for k, v in wanted.items()) and (name is None or meta.get("name") == name)

    return match
