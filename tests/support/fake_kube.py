"""A fake Kubernetes API server: the list and watch JSON the real API serves, for two resources.

Serves ``GET /api/v1/namespaces/{ns}/pods`` and
``GET /apis/inference.networking.k8s.io/v1/namespaces/{ns}/inferencepools`` (or the
older ``inference.networking.x-k8s.io/v1alpha2`` group, ``pool_api``): a
list (``{"kind": "PodList", "metadata": {"resourceVersion"}, "items"}``), or with
``watch=true`` a stream of newline-delimited ``{"type": "ADDED"|"MODIFIED"|"DELETED",
"object": {...}}`` events after ``resourceVersion``, as the API documents them
("Efficient detection of changes", the watch event shape of ``WatchEvent``). Label
selectors (``a=b,c=d``) and the ``metadata.name`` field selector are honoured. Every
request must carry ``Authorization: Bearer <token>`` (401 with a ``Status`` otherwise).
Tests change the objects with ``put`` and ``delete``; each change bumps the resource
version and reaches open watches at once. As the API does, a watch from a
``resourceVersion`` first replays the changes after it; one from a version older
than the history kept (``compact``, as etcd compaction does) gets a single
``ERROR`` event with a 410 ``Expired`` ``Status`` and ends. ``end_watches`` ends
every open watch (the server's ``timeoutSeconds``, or a restart); ``hold`` makes
new watch requests wait until ``release``, so a test decides what happened while
no watch was open.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import trustme
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from sidecar.sim.servers import ServerThread, serve

GROUP_PATH = "/apis/{group}/namespaces/{{namespace}}/inferencepools"
V1 = "inference.networking.k8s.io/v1"
ALPHA = "inference.networking.x-k8s.io/v1alpha2"  # the older group: a flat selector, targetPortNumber


def pod(name: str, ip: str, labels: dict[str, str], phase: str = "Running") -> dict[str, Any]:
    return {
        "metadata": {"name": name, "namespace": "llm", "labels": labels},
        "spec": {"containers": [{"name": "vllm", "image": "vllm"}]},
        "status": {"phase": phase, "podIP": ip, "podIPs": [{"ip": ip}]},
    }


def alpha_pool(name: str, selector: dict[str, str], port: int) -> dict[str, Any]:
    """An InferencePool as inference.networking.x-k8s.io/v1alpha2 has it."""
    spec = {"selector": selector, "targetPortNumber": port, "extensionRef": {"name": "epp"}}
    return {"metadata": {"name": name, "namespace": "llm"}, "spec": spec}


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

    def __init__(self, token: str, pool_api: str = V1) -> None:
        self.token = token
        self.pool_api = pool_api  # group/version the InferencePools are served under
        self.kinds = {"pods": ("v1", "Pod"), "inferencepools": (pool_api, "InferencePool")}
        self.version = 1
        self.objects: dict[str, dict[str, dict[str, Any]]] = {"pods": {}, "inferencepools": {}}
        self.watchers: list[tuple[str, asyncio.Queue[dict[str, Any]]]] = []
        self.requests: list[str] = []
        self.loop: asyncio.AbstractEventLoop | None = None
        self.history: list[tuple[int, str, dict[str, Any]]] = []  # (version, resource, event)
        self.compacted = 0  # a watch from a version below this one gets 410 Gone
        self._open = asyncio.Event()  # set: watch requests are answered (cleared by ``hold``)
        self._open.set()

    def put(self, resource: str, obj: dict[str, Any]) -> None:
        """Create or replace (thread-safe: runs on the server's loop)."""
        self._call(self._change, resource, obj, False)

    def delete(self, resource: str, name: str) -> None:
        self._call(self._change, resource, {"metadata": {"name": name}}, True)

    def end_watches(self) -> None:
        """End every open watch: its stream closes, as at the server's ``timeoutSeconds``."""
        self._call(self._end)

    def compact(self) -> None:
        """Forget the changes made so far: a watch resuming before now gets 410 Gone."""
        self._call(self._compact)

    def hold(self) -> None:
        """New watch requests wait (unanswered) until ``release``."""
        self._call(self._open.clear)

    def release(self) -> None:
        self._call(self._open.set)

    def list_requests(self, resource: str) -> list[str]:
        """The URLs of the lists (not watches) of ``resource`` served so far."""
        return [u for u in self.requests if f"/{resource}" in u and "watch=" not in u]

    def watch_requests(self, resource: str) -> list[str]:
        """The URLs of the watches of ``resource`` asked for so far."""
        return [u for u in self.requests if f"/{resource}" in u and "watch=" in u]

    def _end(self) -> None:
        for _, queue in self.watchers:
            queue.put_nowait(None)

    def _compact(self) -> None:
        self.compacted, self.history = self.version, []

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
        api_version, kind_name = self.kinds[resource]
        obj = {**obj, "apiVersion": api_version, "kind": kind_name}
        obj["metadata"] = {**obj["metadata"], "resourceVersion": str(self.version)}
        if not deleted:
            store[name] = obj
        event = {"type": kind, "object": obj}
        self.history.append((self.version, resource, event))
        for watched, queue in self.watchers:
            if watched == resource:
                queue.put_nowait(event)

    def app(self) -> Starlette:
        async def pods(request: Request) -> Response:
            return await self._serve(request, "pods")

        async def pools(request: Request) -> Response:
            return await self._serve(request, "inferencepools")

        @contextlib.asynccontextmanager
        async def lifespan(app: Starlette) -> AsyncIterator[None]:
            self.loop = asyncio.get_running_loop()
            yield

        pool_path = GROUP_PATH.format(group=self.pool_api)
        routes = [Route("/api/v1/namespaces/{namespace}/pods", pods), Route(pool_path, pools)]
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
            api_version, kind = self.kinds[resource]
            body = {
                "apiVersion": api_version,
                "kind": f"{kind}List",
                "metadata": {"resourceVersion": str(self.version)},
            }
            return JSONResponse({**body, "items": items})
        await self._open.wait()
        queue: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        for event in self._since(resource, request.query_params.get("resourceVersion"), items):
            queue.put_nowait(event)
        entry = (resource, queue)
        self.watchers.append(entry)

        async def events() -> AsyncIterator[bytes]:
            try:
                while (event := await queue.get()) is not None:
                    if event["type"] in ("DELETED", "ERROR") or match(event["object"]):
                        yield json.dumps(event).encode() + b"\n"
                    if event["type"] == "ERROR":
                        return
            finally:
                self.watchers.remove(entry)

        return StreamingResponse(events(), media_type="application/json")

    def _since(self, resource: str, version: str | None, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """What a watch starts with: the changes after ``version`` (none given: every object,
        ADDED), or 410 Gone when they are no longer kept."""
        if not version:
            return [{"type": "ADDED", "object": o} for o in items]
        if int(version) < self.compacted:
            message = f"too old resource version: {version} ({self.compacted})"
            status = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure"}
            gone = {**status, "message": message, "reason": "Expired", "code": 410}
            return [{"type": "ERROR", "object": gone}]
        return [e for v, r, e in self.history if r == resource and v > int(version)]


def _matcher(labels: str | None, fields: str | None) -> Any:
    wanted = dict(part.split("=", 1) for part in (labels or "").split(",") if "=" in part)
    name = dict(part.split("=", 1) for part in (fields or "").split(",") if "=" in part).get("metadata.name")

    def match(obj: dict[str, Any]) -> bool:
        meta = obj.get("metadata", {})
        have = meta.get("labels") or {}
        return all(have.get(k) == v for k, v in wanted.items()) and (name is None or meta.get("name") == name)

    return match


TOKEN = "service-account-token"


LABELS = {"llm-d.ai/inferenceServing": "true"}


@contextmanager
def kube_api(tmp: Path, ca: trustme.CA, pool_api: str = V1) -> Iterator[tuple[FakeKube, ServerThread, Path]]:
    """The fake API over HTTPS, and a service-account directory (token, ca.crt, namespace)."""
    fake = FakeKube(TOKEN, pool_api)
    server_cert = ca.issue_cert("127.0.0.1")
    with (
        server_cert.cert_chain_pems[0].tempfile() as crt,
        server_cert.private_key_pem.tempfile() as key,
        serve(fake.app(), ssl_certfile=crt, ssl_keyfile=key) as api,
    ):
        account = tmp / "serviceaccount"
        account.mkdir()
        (account / "token").write_text(TOKEN)
        (account / "namespace").write_text("llm")
        ca.cert_pem.write_to_path(str(account / "ca.crt"))
        yield fake, api, account
