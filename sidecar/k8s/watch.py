"""The InferencePool and its pods, listed then watched from the Kubernetes API with lightkube.

lightkube is the client: maintained, asynchronous, typed models for pods and
generic resources for CRDs such as InferencePool, built on httpx as the rest
of the sidecar's HTTP is, and small (no generated API surface of thousands of
modules, no second HTTP stack). Auth is the pod's service account, in cluster:
``KUBERNETES_SERVICE_HOST``/``_PORT`` and the token and CA under
``kube_service_account``.

Two loops, each "list, then watch from the list's resourceVersion": one for the
pool (by name), one for the pods its selector matches, restarted when the
selector changes. An error, or a watch that expired (410 Gone), lists again
after a short backoff; a watch the server ended is resumed where it stopped.
Every change recomputes both allowlists at once (``members``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

from lightkube import AsyncClient, KubeConfig
from lightkube.generic_resource import create_namespaced_resource
from lightkube.resources.core_v1 import Pod

from sidecar.config import Config
from sidecar.config.rules import POOL_VERSIONS
from sidecar.k8s.members import LiveAllowlist, Members, first_list

log = logging.getLogger("sidecar.k8s")


def pool_resource(group: str) -> Any:
    """The InferencePool resource of ``group``: v1, or v1alpha2 for the older x-k8s.io group."""
    return create_namespaced_resource(group, POOL_VERSIONS[group], "InferencePool", "inferencepools")


BACKOFF_INITIAL, BACKOFF_MAX = 0.2, 5.0
WATCH_SECONDS = 300  # the server ends a watch after this; it is resumed at once

# Told each change of the lists: (router mode's entries, the release entries, ``Watch.synced``).
Publish = Callable[[list[str], list[str], bool], None]


class Watch:
    """Keeps ``prefill`` and ``release`` equal to the pool's members (see the module docstring),
    and tells ``publish`` each change (the supervisor's, for its workers: ``sidecar.k8s.shared``)."""

    def __init__(
        self,
        client: AsyncClient,
        config: Config,
        prefill: LiveAllowlist,
        release: LiveAllowlist,
        publish: Publish | None = None,
    ) -> None:
        self._client, self._publish = client, publish
        self._namespace, self._name = config.inference_pool.split("/")
        self._pool = pool_resource(config.pool_group)
        self._side_channel = config.pool_side_channel_ports
        self._lists = prefill, release
        self.members = Members()
        self._pool_synced = self._pods_synced = False
        self._first = asyncio.Event()
        self._pods: asyncio.Task[None] | None = None
        self._task: asyncio.Task[None] | None = None

    @property
    def synced(self) -> bool:
        """The pool, and the pods it selects, were listed at least once."""
        return self._pool_synced and (self._pods_synced or not self.members.exists)

    def launch(self) -> None:
        """List, then watch, on a task of its own; ``first_list`` waits for the first lists."""
        self._task = asyncio.create_task(self._loop("pool", self._pool_round))

    async def start(self, wait: float) -> None:
        """``launch``, then wait up to ``wait`` seconds for the first lists."""
        self.launch()
        await self.first_list(wait)

    async def first_list(self, wait: float) -> None:
        """Wait up to ``wait`` seconds for the pool, and the pods it selects, to be listed."""
        await first_list(self._first, wait, lambda: self.synced)

    async def close(self) -> None:
        for task in (self._pods, self._task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        await self._client.close()

    async def _loop(self, what: str, round_: Any) -> None:
        backoff = BACKOFF_INITIAL
        while True:
            try:
                await round_()
                backoff = BACKOFF_INITIAL
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # any API or transport error: list again after a pause
                log.warning(
                    "Kubernetes watch failed, listing again", extra={"watch": what, "detail": repr(exc)}
                )
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, BACKOFF_MAX)

    async def _pool_round(self) -> None:
        fields: dict[str, Any] = {"metadata.name": self._name}
        listing = self._client.list(self._pool, namespace=self._namespace, fields=fields)
        pools = [_plain(pool) async for pool in listing]
        self._pool_changed(pools[0] if pools else None)
        self._pool_synced = True
        self._updated()
        events = self._client.watch(
            self._pool,
            namespace=self._namespace,
            fields=fields,
            resource_version=listing.resourceVersion,
            server_timeout=WATCH_SECONDS,
        )
        async for kind, pool in events:
            self._pool_changed(None if kind == "DELETED" else _plain(pool))
            self._updated()

    def _pool_changed(self, pool: dict[str, Any] | None) -> None:
        if not self.members.apply_pool(pool):
            return
        if self._pods is not None:
            self._pods.cancel()
        self.members.pods.clear()
        self._pods_synced = False
        if self.members.exists and self.members.selector:
            self._pods = asyncio.create_task(self._loop("pods", self._pods_round))

    async def _pods_round(self) -> None:
        labels: dict[str, Any] = dict(self.members.selector)
        listing = self._client.list(Pod, namespace=self._namespace, labels=labels)
        pods = [_plain(item) async for item in listing]
        self.members.pods.clear()
        for pod in pods:
            self.members.apply_pod("ADDED", pod)
        self._pods_synced = True
        self._updated()
        events = self._client.watch(
            Pod,
            namespace=self._namespace,
            labels=labels,
            resource_version=listing.resourceVersion,
            server_timeout=WATCH_SECONDS,
        )
        async for kind, changed in events:
            self.members.apply_pod(kind, _plain(changed))
            self._updated()

    def _updated(self) -> None:
        prefill, release = self.members.entries(self._side_channel)
        self._lists[0].replace(prefill)
        self._lists[1].replace(release)
        if self._publish is not None:
            self._publish(prefill, release, self.synced)
        if self.synced:
            self._first.set()
        log.info("InferencePool members", extra={"pool": self._name, "prefill": prefill})


def _plain(obj: Any) -> dict[str, Any]:
    """A lightkube object as the API's JSON (a dict)."""
    data: dict[str, Any] = obj.to_dict()
    return data


def start_pool_watch(
    config: Config, prefill: LiveAllowlist, release: LiveAllowlist, publish: Publish | None = None
) -> Watch:
    """A watch with in-cluster auth, started (its first lists are not waited for here)."""
    kube = KubeConfig.from_service_account(service_account=config.kube_service_account)
    client = AsyncClient(config=kube, namespace=config.inference_pool.split("/")[0], trust_env=False)
    watch = Watch(client, config, prefill, release, publish)
    watch.launch()
    return watch
