"""The uvicorn servers the sidecar's protocol runs in: the one module of ``sidecar/`` that uses uvicorn.

uvicorn runs each server: it loads the application, runs its lifespan, and at
shutdown stops accepting, asks each connection to close and waits for the
requests in flight (``timeout_graceful_shutdown``). The HTTP/1.1 protocol is
the sidecar's own (``sidecar.server.protocol``), given to uvicorn as a
protocol class (``Config(http=...)``). Only uvicorn's public names are used
(``uvicorn.Config``, ``uvicorn.Server``; ``tests/unit/test_uvicorn_public.py``
scans ``sidecar/`` for anything else). What the sidecar relies on of them, each
checked by ``tests/unit/test_uvicorn_contract.py`` against the installed
uvicorn: ``Server.startup(sockets)`` and ``capture_signals()`` overridden (the
server's own accept loop, ``sidecar.server.accept``, and no ``sys.exit`` when
the lifespan fails); its ``config``, ``server_state``, ``lifespan``,
``servers``, ``started`` and ``should_exit``; ``Config.load()``, ``ssl`` and
``http_protocol_class``; and how its shutdown treats the connections and tasks
in ``server_state``.
"""

from __future__ import annotations

import contextlib
import functools
import socket
from collections.abc import Generator
from typing import TYPE_CHECKING, Any, cast

import uvicorn

from sidecar.server.accept import Acceptor
from sidecar.server.limits import ServerLimits
from sidecar.server.memory import settle_heap
from sidecar.server.protocol import guarded_protocol

if TYPE_CHECKING:
    from sidecar.tls.server import ServerTLS


def server_options(limits: ServerLimits) -> dict[str, object]:
    """The uvicorn options that serve with the sidecar's protocol under ``limits`` (also used by the
    integration tests, which run uvicorn's own ``Server``)."""
    return {"http": guarded_protocol(limits), "ws": "none"}


class Server(uvicorn.Server):
    """A uvicorn server whose signals and start-up failure are handled by ``serve``, not by itself.

    With ``freeze``, once started (the lifespan included) it moves every object then alive out of
    the cyclic garbage collector's sight (``gc.freeze``): what start-up built (modules, the app,
    its clients) lives as long as the process, and the collector's full passes no longer walk it
    (``sidecar.server.memory.settle_heap``).
    """

    startup_failed = False

    def __init__(self, config: uvicorn.Config, freeze: bool = False) -> None:
        super().__init__(config)
        self.freeze_heap = freeze

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await self.lifespan.startup()
        if self.lifespan.should_exit:  # uvicorn would end the process: stop this server only
            self.startup_failed = self.should_exit = True
            return
        config, state, kind = self.config, self.server_state, cast(Any, self.config.http_protocol_class)
        protocol = functools.partial(kind, config=config, server_state=state, app_state=self.lifespan.state)
        self.servers = [Acceptor(s, protocol, config.ssl) for s in sockets or ()]  # type: ignore[misc]
        self.started = True
        if self.freeze_heap and not self.should_exit:
            settle_heap()


def uvicorn_config(
    app: object, host: str, port: int, limits: ServerLimits, **extra: object
) -> uvicorn.Config:
    """One server's uvicorn settings: the sidecar's protocol, no uvicorn logging."""
    options: dict[str, object] = {
        "host": host,
        "port": port,
        "loop": "none",
        "log_config": None,
        # True keeps uvicorn from cutting uvicorn.access off for every server in the process
        # (Config.configure_logging); each protocol says whether it logs (ServerLimits.access_log).
        "access_log": True,
        "proxy_headers": False,  # the sidecar never reads the client address
        **server_options(limits),
        **extra,
    }
    return uvicorn.Config(app, **options)  # type: ignore[arg-type]


def serve_tls(uv: uvicorn.Config, tls: ServerTLS | None) -> None:
    """Serve ``uv`` with ``tls``'s context: uvicorn builds one only from file names, so the
    config is loaded here and its context replaced (the server then does not load it again)."""
    if tls is not None:
        uv.load()
        uv.ssl = tls.context
