"""The sidecar's own NIXL agent, owned by one dedicated thread.

NIXL calls block (``add_remote_agent`` creates UCX endpoints, ``send_notif``
may wait on the transport), so none runs on the event loop: every call is
submitted to a single-thread executor that also created the agent, and the
async methods await its result. NIXL is imported lazily (``nixl._api``, else
``nixl_cu12._api``) so the sidecar starts without it when another strategy is
chosen. NIXL exceptions become ``NixlError`` here, once.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from sidecar.nixl import NixlError

log = logging.getLogger(__name__)

_T = TypeVar("_T")
_MODULES = ("nixl._api", "nixl_cu12._api")


def import_nixl() -> Any:
    """The NIXL Python API module; raises ``NixlError`` when no build is installed."""
    errors = []
    for name in _MODULES:
        try:
            return importlib.import_module(name)
        except ImportError as exc:
            errors.append(f"{name}: {exc}")
    raise NixlError("NIXL is not installed (" + "; ".join(errors) + ")")


def agent_name() -> str:
    """A name unique to this process and start (P learns it from our notifications)."""
    return f"kvr-sidecar-{uuid.uuid4()}"


class NixlPeer:
    """One NIXL agent (UCX backend) and the thread that owns it."""

    def __init__(self, name: str | None = None, backends: Sequence[str] = ("UCX",)) -> None:
        self.name = name or agent_name()
        self._backends = list(backends)
        self._executor: ThreadPoolExecutor | None = None
        self._agent: Any = None

    def ready(self) -> bool:
        return self._agent is not None

    async def start(self) -> None:
        """Create the agent on its thread; raises ``NixlError`` when NIXL is unusable."""
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvr-nixl")
        self._agent = await self._call(self._create)
        log.info("NIXL agent started", extra={"agent": self.name, "backends": self._backends})

    def _create(self) -> Any:
        api = import_nixl()
        config = api.nixl_agent_config(backends=self._backends)
        return api.nixl_agent(self.name, config)

    async def close(self) -> None:
        """Drop the agent on its thread, then stop the thread."""
        executor, self._executor = self._executor, None
        if executor is None:
            return
        holder = [self._agent] if self._agent is not None else []
        self._agent = None
        # The last reference dies on the owning thread, so UCX is torn down there.
        await asyncio.get_running_loop().run_in_executor(executor, holder.clear)
        executor.shutdown(wait=True)

    async def metadata(self) -> bytes:
        """This agent's own metadata (for tests and diagnostics)."""
        return bytes(await self._call(lambda: self._require().get_agent_metadata()))

    async def add_remote(self, metadata: bytes) -> str:
        """Load a P worker's agent metadata; returns the remote agent's name."""
        name = await self._call(lambda: self._require().add_remote_agent(metadata))
        return name.decode() if isinstance(name, bytes) else str(name)

    async def remove_remote(self, names: Sequence[str]) -> None:
        """Forget remote agents (disconnects them); failures are logged, not raised."""

        def remove() -> None:
            agent = self._require()
            for name in names:
                try:
                    agent.remove_remote_agent(name)
                except Exception as exc:  # NIXL raises its own exception types
                    log.warning("remove_remote_agent failed", extra={"remote": name, "error": str(exc)})

        await self._call(remove)

    async def notify(self, name: str, message: bytes) -> None:
        """Send one notification to a remote agent."""
        await self._call(lambda: self._require().send_notif(name, message))

    async def notify_many(self, messages: Sequence[tuple[str, bytes]]) -> list[str | None]:
        """Send several notifications in one hop to the NIXL thread.

        Returns, per message, None when it was sent or the error text; a failure
        does not stop the others (each rank frees independently).
        """

        def send() -> list[str | None]:
            agent = self._require()
            results: list[str | None] = []
            for name, message in messages:
                try:
                    agent.send_notif(name, message)
                    results.append(None)
                except Exception as exc:  # NIXL raises its own exception types
                    results.append(f"{type(exc).__name__}: {exc}")
            return results

        executor = self._executor
        if executor is None:
            raise NixlError("NIXL agent is not started")
        return await asyncio.get_running_loop().run_in_executor(executor, send)

    def _require(self) -> Any:
        if self._agent is None:
            raise NixlError("NIXL agent is not started")
        return self._agent

    async def _call(self, fn: Callable[[], _T]) -> _T:
        executor = self._executor
        if executor is None:
            raise NixlError("NIXL agent is not started")
        try:
            return await asyncio.get_running_loop().run_in_executor(executor, fn)
        except NixlError:
            raise
        except Exception as exc:  # NIXL raises its own exception types
            raise NixlError(f"{type(exc).__name__}: {exc}") from exc
