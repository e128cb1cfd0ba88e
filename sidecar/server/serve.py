"""``kv-release-sidecar serve``: run the proxy and admin servers until SIGTERM.

Shutdown is bounded and ordered: on SIGTERM or SIGINT ``/readyz`` turns 503
first, the proxy keeps serving for ``shutdown_delay`` (so load balancers
notice), then stops accepting and drains in-flight requests for up to
``drain_timeout``; the lifespan then flushes queued releases for up to
``flush_timeout`` and the admin server stops last. Both servers enforce the
client limits of ``sidecar.server.protocol``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import resource
import signal
import socket
import sys
from dataclasses import dataclass

from sidecar import config as config_mod
from sidecar import extras
from sidecar.app import Deps, ProxyApp, create_admin_app, create_app
from sidecar.app.ranks import RankFront
from sidecar.config import args as config_args
from sidecar.exceptions import SidecarError
from sidecar.k8s.account import check_service_account
from sidecar.observability import logs, tracing
from sidecar.proxy.trust import Trust
from sidecar.server import memory, workers
from sidecar.server.host import Server, serve_tls, uvicorn_config
from sidecar.server.limits import ServerLimits
from sidecar.tls.server import ServerTLS, TLSFileError, serving
from sidecar.tls.trust import CAFileError, trust_store

log = logging.getLogger("sidecar.serve")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    config_args.add_arguments(parser)


def run(args: argparse.Namespace) -> int:
    try:
        config, sources = config_args.load(args)
    except config_mod.ConfigError as exc:
        print(f"kv-release-sidecar: {exc}", file=sys.stderr)
        return 2
    return start(config, sources)


def start(config: config_mod.Config, sources: dict[str, str]) -> int:
    """Serve ``config`` until SIGTERM (``sources``: where each setting came from, for errors)."""
    stop_on_signals()  # a SIGTERM while starting ends the start (the event loop's handler comes later)
    logs.setup(config.log_level, config.log_format, config.access_log)  # start-up's warnings are logged
    try:
        try:
            trust = Trust(config)  # secrets read once, before any socket opens
            tracing.require(config)  # the otel extra installed when tracing is configured
            tls = preflight(config)
        except config_mod.ConfigError as exc:
            raise exc.at(sources.get(exc.field, exc.source)) from exc
        if config.release in config_args.NIXL_STRATEGIES:
            extras.require(f"--release {config.release}", ["nixl"])
        sockets = listen(config)
    except (config_mod.ConfigError, ListenError, TLSFileError, extras.MissingExtra) as exc:
        print(f"kv-release-sidecar: {exc}", file=sys.stderr)
        return 2
    memory.release_large_buffers()
    raise_file_limit(config.pool_size)
    for warning in config_mod.unknown_env(os.environ):
        log.warning(warning)
    try:
        import uvloop

        uvloop.install()
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        pass
    size = workers.count(config.workers)
    if size > 1:
        log.info("starting workers", extra={"workers": size, "setting": config.workers})
        return workers.supervise(config, sockets, size, tls.admin)
    try:
        asyncio.run(serve(config, sockets=sockets, deps=Deps(trust=trust), tls=tls))
    except StartupFailed as exc:
        print(f"kv-release-sidecar: {exc}", file=sys.stderr)
        return 1
    return 0


def stop_on_signals() -> None:
    """SIGTERM and SIGINT end the process while it starts: before the event loop installs its own
    handlers, and whatever start-up step runs (a read of a slow file system). In a container the
    sidecar is PID 1, which the kernel sends no signal its default action would end: without a
    handler a SIGTERM during start-up would be lost, and the pod killed at its grace period."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _stop_starting)


def _stop_starting(signum: int, frame: object) -> None:
    log.warning("stopped while starting", extra={"signal": signal.Signals(signum).name})
    raise SystemExit(128 + signum)


class ListenError(SidecarError):
    """A port that cannot be listened on (in use, not permitted, no such address)."""


def listen(config: config_mod.Config) -> dict[str, list[socket.socket]]:
    """Bind the proxy and admin ports before anything starts, so a busy port is one clear error.

    Data-parallel ranks above 0 listen on ``port + rank`` (keys ``port+1``, ...)."""
    bound: dict[str, list[socket.socket]] = {}
    ports = [("port", config.host, config.port, "--port")]
    ports += [
        (f"port+{r}", config.host, config.port + r, "--data-parallel-size")
        for r in range(1, config.data_parallel_size)
    ]
    ports.append(("admin_port", config.admin_host, config.admin_port, "--admin-port"))
    try:
        for name, host, port, flag in ports:
            bound[name] = _bind(host, port, flag)
    except ListenError:
        for sock in (s for socks in bound.values() for s in socks):
            sock.close()
        raise
    return bound


def _bind(host: str, port: int, flag: str) -> list[socket.socket]:
    """Listening sockets for every address ``host`` resolves to, as asyncio's create_server binds."""
    sockets: list[socket.socket] = []
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        for family, kind, proto, _, address in dict.fromkeys(infos):
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind((address[0], port, *address[2:]))
            sock.listen(BACKLOG)
            port = sock.getsockname()[1]  # port 0: the one picked first, on every address
    except OSError as exc:
        for sock in sockets:
            sock.close()
        shown = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        raise ListenError(f"cannot listen on {shown} ({flag}): {exc.strerror or exc}") from exc
    return sockets


# The kernel caps it at net.core.somaxconn (4096 on Linux 5.4+): a burst of thousands of clients
# connecting at once waits in it instead of being refused.
BACKLOG = 4096
# Open files beyond two per connection to D (the client's and D's): listeners, probes, logs.
SPARE_FILES = 256


def raise_file_limit(pool_size: int) -> None:
    """Lift the soft limit on open files to the hard one, as nginx's ``worker_rlimit_nofile`` or
    Go's runtime do: every stream holds two sockets, and the usual soft limit of 1024 would stop
    the sidecar at about 500 streams. Warns when even the hard limit is below what ``pool_size``
    streams need."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as exc:
            log.warning("cannot raise the open-files limit", extra={"soft": soft, "detail": str(exc)})
    need = 2 * pool_size + SPARE_FILES
    if soft < need:
        log.warning(
            "open-files limit below what pool_size streams need (raise ulimit -n)",
            extra={"limit": soft, "needed": need, "setting": "pool_size"},
        )


class StartupFailed(Exception):
    """The app's lifespan failed to start (the reason is logged by ``sidecar.app``)."""


async def serve(
    config: config_mod.Config,
    stop: asyncio.Event | None = None,
    sockets: dict[str, list[socket.socket]] | None = None,
    deps: Deps | None = None,
    tls: Serving | None = None,
) -> None:
    """Run both servers until ``stop`` is set or a termination signal arrives.

    ``sockets`` are the listening sockets from ``listen`` (bound here when not given).
    """
    sockets = sockets or listen(config)
    tls = tls or Serving()
    app: ProxyApp = create_app(config, deps)
    proxies = [_rank_server(app, config, rank, tls.proxy) for rank in range(config.data_parallel_size)]
    admin_limits = ServerLimits.of(config, admin=True)
    admin = Server(
        uvicorn_config(
            create_admin_app(app), config.admin_host, config.admin_port, admin_limits, lifespan="off"
        )
    )
    serve_tls(admin.config, tls.admin)
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    for name, socks in sockets.items():
        log.info("listening", extra={"setting": name, "addresses": [_shown(s) for s in socks]})
    keys = ["port", *(f"port+{r}" for r in range(1, config.data_parallel_size))]
    proxy_tasks = [
        asyncio.create_task(p.serve(sockets=sockets[k])) for p, k in zip(proxies, keys, strict=True)
    ]
    admin_task = asyncio.create_task(admin.serve(sockets=sockets["admin_port"]))
    waiter = asyncio.create_task(stop.wait())
    reloads = [asyncio.create_task(t.watch()) for t in (tls.proxy, tls.admin) if t is not None and t.cert_dir]
    await asyncio.wait({*proxy_tasks, admin_task, waiter}, return_when=asyncio.FIRST_COMPLETED)
    log.info("shutting down: readiness off, draining")
    if app.runtime is not None:
        app.runtime.drain()
    await asyncio.sleep(config.shutdown_delay)
    for server in proxies:  # rank 0 last: its lifespan closes what the other ranks use
        server.should_exit = True
    await asyncio.gather(*proxy_tasks, return_exceptions=True)
    admin.should_exit = True
    await asyncio.gather(admin_task, return_exceptions=True)
    waiter.cancel()
    for task in reloads:  # they poll until cancelled: waiting on them first never returns
        task.cancel()
    await asyncio.gather(*reloads, return_exceptions=True)
    if proxies[0].startup_failed:
        raise StartupFailed("start-up failed (the error is logged above)")


@dataclass(frozen=True, slots=True)
class Serving:
    """The serving TLS of the proxy port(s) and of the admin port (None: plain HTTP)."""

    proxy: ServerTLS | None = None
    admin: ServerTLS | None = None


def preflight(config: config_mod.Config) -> Serving:
    """What start-up needs beyond the config, checked before any socket opens: the llm-d extra's
    parts, the service account for the InferencePool watch, the certificates served, and the ones
    outbound TLS trusts (read here, before the event loop runs, and kept: ``sidecar.tls.trust``);
    raises a one-line error."""
    try:
        trust_store(config)
    except CAFileError as exc:
        raise config_mod.ConfigError("tls_ca_file", exc.path, exc.why) from exc
    if config.inference_pool:
        extras.require_module(
            f"the InferencePool watch (inference_pool {config.inference_pool})", "llm-d", "lightkube"
        )
        check_service_account(config)
    if config.tls and not config.tls_cert_dir:
        extras.require_module(
            "a self-signed serving certificate (TLS without a certificate directory)", "llm-d", "cryptography"
        )
    version, ciphers = config.tls_min_version, config.tls_ciphers
    return Serving(
        serving(config.tls_cert_dir, config.tls, version, ciphers),
        serving(config.admin_tls_cert_dir, bool(config.admin_tls_cert_dir), version, ciphers),
    )


def _rank_server(app: ProxyApp, config: config_mod.Config, rank: int, tls: ServerTLS | None) -> Server:
    """The uvicorn server of one data-parallel rank's listener; rank 0 runs the app's lifespan."""
    # One rank whose answers need nothing of the rank front (llm-d's /health, its rank table) is the app.
    alone = config.data_parallel_size == 1 and not (app.answers.serves_health or app.answers.keeps_rank_table)
    front = app if alone else RankFront(app, rank, config)
    options: dict[str, object] = {"lifespan": "on" if rank == 0 else "off", "backlog": BACKLOG}
    uv = uvicorn_config(
        front,
        config.host,
        config.port + rank,
        ServerLimits.of(config),
        timeout_graceful_shutdown=config.drain_timeout,
        **options,
    )
    serve_tls(uv, tls)
    return Server(uv, freeze=rank == 0)


def _shown(sock: socket.socket) -> str:
    name = sock.getsockname()
    if isinstance(name, str):
        return name  # a worker's admin app on its Unix socket
    host, port = name[:2]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
