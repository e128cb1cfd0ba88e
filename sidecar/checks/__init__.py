"""The checks ``kv-release-sidecar check`` runs, and what they share.

A check is an async function from a ``Context`` (the loaded config, where each
setting came from, an HTTP client for D) to the ``Finding`` lines it reports:
one usually, none when it does not apply to the configured strategy. No check
ever contacts P: nothing reaches P's side channel, no NIXL agent is created.
``decode`` holds the checks that ask D (health, version, control endpoint),
``settings`` those that read the config, the files it names and DNS.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Literal

import httpx
import msgspec

from sidecar.config import Config
from sidecar.tls.client import outbound

Status = Literal["ok", "warn", "fail"]

#: One request to D (connect, headers and body together): D is in the same pod.
CHECK_TIMEOUT = 5.0


class Finding(msgspec.Struct, frozen=True):
    """One line of the report: ``<status>  <name>: <detail>; <fix>`` (no fix when all is well)."""

    name: str
    status: Status
    detail: str
    fix: str = ""

    def line(self) -> str:
        text = f"{self.status:<4}  {self.name}: {self.detail}"
        return f"{text}; {self.fix}" if self.fix else text


@dataclass
class Context:
    """What every check may read: the config, its sources, and D's answers (each asked once)."""

    config: Config
    sources: dict[str, str]
    client: httpx.AsyncClient
    _answers: dict[str, tuple[int, bytes] | str] = field(default_factory=dict)

    def source(self, name: str) -> str:
        """Where setting ``name`` came from: its flag, ``KVR_*`` variable or file and key."""
        return self.sources.get(name) or "--" + name.replace("_", "-")

    @property
    def strategy(self) -> str:
        return self.config.release

    async def ask_decode(self, path: str) -> tuple[int, bytes] | str:
        """D's status and body for ``GET <decode_url><path>``, or why D could not be asked."""
        if path not in self._answers:
            url = self.config.decode_url.rstrip("/") + path
            try:
                response = await self.client.get(url)
                self._answers[path] = (response.status_code, response.content[:4096])
            except httpx.TimeoutException:
                self._answers[path] = f"no answer from {url} within {CHECK_TIMEOUT:g} s"
            except httpx.HTTPError as exc:
                self._answers[path] = f"cannot connect to {url} ({type(exc).__name__}: {exc})"
        return self._answers[path]


Check = Callable[[Context], Awaitable[list[Finding]]]


def ok(name: str, detail: str) -> Finding:
    return Finding(name, "ok", detail)


def warn(name: str, detail: str, fix: str) -> Finding:
    return Finding(name, "warn", detail, fix)


def fail(name: str, detail: str, fix: str) -> Finding:
    return Finding(name, "fail", detail, fix)


def client(config: Config) -> httpx.AsyncClient:
    """The client the checks ask D with: one short bound whatever the proxy's own timeouts (the
    check must end quickly), no proxy variables (``trust_env=False``), and D's certificate
    verified as the proxy path verifies it (``sidecar.tls.client``)."""
    verify = outbound(config, config.decode_tls_insecure)
    return httpx.AsyncClient(timeout=httpx.Timeout(CHECK_TIMEOUT), trust_env=False, verify=verify)
