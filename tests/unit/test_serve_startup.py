"""``serve``'s uvicorn server: what start-up built is frozen out of the cyclic collector's sight."""

from __future__ import annotations

import asyncio
import gc
import socket
from collections.abc import Iterator
from typing import Any

import pytest

from sidecar.server.host import Server, uvicorn_config
from sidecar.server.limits import ServerLimits
from sidecar.server.memory import YOUNG_COLLECTION


async def _app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})


@pytest.fixture
def unfrozen() -> Iterator[None]:
    gc.unfreeze()
    threshold = gc.get_threshold()
    yield
    gc.unfreeze()  # the rest of the test run collects as usual
    gc.set_threshold(*threshold)


@pytest.mark.parametrize("freeze", [True, False])
async def test_objects_alive_after_start_up_are_frozen(unfrozen: None, freeze: bool) -> None:
    with socket.create_server(("127.0.0.1", 0)) as sock:
        config = uvicorn_config(_app, "127.0.0.1", 0, ServerLimits(), lifespan="on")
        server = Server(config, freeze=freeze)
        task = asyncio.create_task(server.serve(sockets=[sock]))
        try:
            while not server.started:  # polled: start-up includes the lifespan
                assert not task.done()
                await asyncio.sleep(0.01)
            frozen = gc.get_freeze_count()
            assert (frozen > 10_000) is freeze  # the modules, the app, uvicorn's server: all of it
            assert (gc.get_threshold()[0] == YOUNG_COLLECTION) is freeze
            assert not freeze or frozen >= len(gc.get_objects()) / 2
        finally:
            server.should_exit = True
            await task
