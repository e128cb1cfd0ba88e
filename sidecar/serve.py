"""``kv-release-sidecar serve``: run the proxy and admin servers until SIGTERM.

Shutdown is bounded and ordered: on SIGTERM or SIGINT ``/readyz`` turns 503
first, the proxy keeps serving for ``shutdown_delay`` (so load balancers
notice), then stops accepting and drains in-flight requests for up to
``drain_timeout``; the lifespan then flushes queued releases for up to
``flush_timeout`` and the admin server stops last. Both servers enforce the
client limits of ``sidecar.limits``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
from collections.abc import Generator

import uvicorn

from sidecar import config as config_mod
from sidecar import logs, memory, tracing
from sidecar.app import ProxyApp, create_admin_app, create_app
from sidecar.limits import ServerLimits, server_options
from sidecar.trust import Trust

log = logging.getLogger("sidecar.serve")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    config_mod.build_parser(parser)


def load_config(args: argparse.Namespace) -> config_mod.Config:
    """Flags > env > file > defaults; raises ``ConfigError``."""
    text = None
    path = args.config or os.environ.get("KVR_CONFIG")
    if path:
        try:
            with open(path, encoding="utf-8") as handle:
                text = handle.read()
        except OSError as exc:
            raise config_mod.ConfigError("config", path, f"cannot read: {exc.strerror}") from exc
    fields = {k: v for k, v in vars(args).items() if not k.startswith("_") and k not in ("config", "command")}
    return config_mod.load(fields, os.environ, text)


def run(args: argparse.Namespace) -> int:
    try:
        config = load_config(args)
        Trust(config)  # secrets readable and present, before any socket opens
        tracing.require(config)  # the otel extra installed when tracing is configured
    except config_mod.ConfigError as exc:
        print(f"kv-release-sidecar: {exc}", file=sys.stderr)
        return 2
    logs.setup(config.log_level, config.log_format)
    memory.release_large_buffers()
    _warn(config)
    try:
        import uvloop

        uvloop.install()
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        pass
    asyncio.run(serve(config))
    return 0


def _warn(config: config_mod.Config) -> None:
    if config.release == "nixl" and not config.prefill_allow:
        log.warning("--release nixl with an empty --prefill-allow: nothing will be released")


class _Server(uvicorn.Server):
    """A uvicorn server whose signals are handled by ``serve``, not by itself."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


def uvicorn_config(
    app: object, host: str, port: int, limits: ServerLimits, **extra: object
) -> uvicorn.Config:
    """One server's uvicorn settings: httptools behind ``GuardedProtocol``, no uvicorn logging."""
    options: dict[str, object] = {
        "host": host,
        "port": port,
        "loop": "none",
        "log_config": None,
        "access_log": False,
        "server_header": False,  # D's own Server/Date headers pass through
        "date_header": False,
        "proxy_headers": False,  # the sidecar never reads the client address
        **server_options(limits),
        **extra,
    }
    return uvicorn.Config(app, **options)  # type: ignore[arg-type]


async def serve(config: config_mod.Config, stop: asyncio.Event | None = None) -> None:
    """Run both servers until ``stop`` is set or a termination signal arrives."""
    app: ProxyApp = create_app(config)
    proxy = _Server(
        uvicorn_config(
            app,
            config.host,
            config.port,
            ServerLimits.of(config),
            lifespan="on",
            timeout_graceful_shutdown=config.drain_timeout,
            backlog=2048,
        )
    )
    admin_limits = ServerLimits.of(config, admin=True)
    admin = _Server(
        uvicorn_config(
            create_admin_app(app), config.admin_host, config.admin_port, admin_limits, lifespan="off"
        )
    )
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    proxy_task = asyncio.create_task(proxy.serve())
    admin_task = asyncio.create_task(admin.serve())
    waiter = asyncio.create_task(stop.wait())
    await asyncio.wait({proxy_task, admin_task, waiter}, return_when=asyncio.FIRST_COMPLETED)
    log.info("shutting down: readiness off, draining")
    if app.runtime is not None:
        app.runtime.draining = True
    await asyncio.sleep(config.shutdown_delay)
    proxy.should_exit = True
    await asyncio.gather(proxy_task, return_exceptions=True)
    admin.should_exit = True
    await asyncio.gather(admin_task, return_exceptions=True)
    waiter.cancel()
