"""The admin port's app: ``/healthz``, ``/readyz`` and ``/metrics``, read from the proxy app's runtime.

A separate Starlette app served on the admin port, so D's own ``/health`` and
``/metrics`` stay reachable through the proxy port.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

if TYPE_CHECKING:
    from sidecar.app.core import ProxyApp


def create_admin_app(app: ProxyApp) -> Starlette:
    """The admin-port app, reading the proxy app's runtime."""

    async def healthz(request: Request) -> Response:
        return PlainTextResponse("ok")

    async def readyz(request: Request) -> Response:
        runtime = app.runtime
        if runtime is None:
            return JSONResponse({"ready": False, "checks": {"started": False}}, status_code=503)
        ok, checks = await runtime.ready()
        body: dict[str, object] = {"ready": ok, "checks": checks}
        detail = runtime.releaser.detail()
        if detail:
            body["release"] = detail
        return JSONResponse(body, status_code=200 if ok else 503)

    async def metrics(request: Request) -> Response:
        runtime = app.runtime
        if runtime is None:
            return Response(generate_latest(CollectorRegistry()), media_type=CONTENT_TYPE_LATEST)
        runtime.metrics.queue_depth.set(runtime.pipeline.depth)
        if runtime.releaser.checked:
            runtime.metrics.decode_can_notify.set(1 if runtime.decode.view().can_notify else 0)
        return Response(generate_latest(runtime.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    routes = [
        Route("/healthz", healthz),
        Route("/readyz", readyz),
        Route("/metrics", metrics),
    ]
    return Starlette(routes=routes)
