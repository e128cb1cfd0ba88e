"""The composition root: the proxy app and its lifespan (``core``), what start-up built
(``runtime``), the admin port's app (``admin``) and the data-parallel ranks (``ranks``,
``decode_ranks``). Nothing below this package imports it."""

from __future__ import annotations

from sidecar.app.admin import create_admin_app
from sidecar.app.core import ProxyApp, create_app
from sidecar.app.runtime import Deps, Runtime, Worker

__all__ = ["Deps", "ProxyApp", "Runtime", "Worker", "create_admin_app", "create_app"]
