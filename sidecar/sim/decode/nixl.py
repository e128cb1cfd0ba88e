"""The decode simulator's "vLLM D" mode: it frees P's blocks the way vLLM's D does.

For an admitted remote-prefill request D's worker handshakes P and sends
one notification per P rank after reading (``sidecar.sim.dclient.DecodeClient.release``), so P
frees admitted requests the normal way and a test can tell a correct
sidecar (which sends nothing for them) from one that double-releases. For
releases that have vLLM's own fix (0.21.0+, ``notify_kv_transfer_request_rejected``), a
rejection raised inside the three wrapped handlers is released by D itself
as well, as ``notify_kv_transfer_request_rejected`` does (not on the token-in
generate route, whose handler is not wrapped).
"""

from __future__ import annotations

import logging
from typing import Any

from sidecar.sim.dclient import DecodeClient
from sidecar.sim.prefill.release import parse_version

logger = logging.getLogger("sidecar.sim.decode_nixl")

FIX_RELEASE = (0, 21, 0)  # first vLLM with notify_kv_transfer_request_rejected
#: Routes whose handler the cleanup does not wrap (0.33.0 ``ServingTokens.serve_tokens``); on
#: ``/v1/messages`` the simulator's handler errors are the chat handler's, which it wraps.
UNWRAPPED_ROUTES = frozenset({"/inference/v1/generate"})


def engine_request_id(route: str, x_request_id: str) -> str:
    """D's own engine request id before vLLM 0.13.0 (P's id is the same)."""
    if route in ("/v1/chat/completions", "/v1/messages"):
        return f"chatcmpl-{x_request_id}"
    if route == "/inference/v1/generate":
        return f"generate-tokens-{x_request_id}"
    if route == "/v1/responses":
        return f"resp_{x_request_id}"
    return f"cmpl-{x_request_id}-0"


class VllmDHooks:
    """``DecodeHooks`` that notify P over real NIXL, like vLLM's D of ``version``."""

    def __init__(self, version: str, timeout: float = 5.0) -> None:
        self.version = version
        self.has_fix = parse_version(version) >= FIX_RELEASE
        self.client = DecodeClient(version, timeout=timeout)
        self.notified: list[tuple[str, str]] = []  # (reason, message) for tests

    async def start(self) -> None:
        await self.client.start()

    async def close(self) -> None:
        await self.client.close()

    async def admitted(self, request_id: str, route: str, kv_transfer_params: dict[str, Any]) -> None:
        await self._release("admitted", request_id, route, kv_transfer_params)

    async def rejected_in_handler(
        self, request_id: str, route: str, kv_transfer_params: dict[str, Any], status: int
    ) -> None:
        if self.has_fix and route not in UNWRAPPED_ROUTES:
            await self._release("engine_fix", request_id, route, kv_transfer_params)

    async def _release(self, reason: str, request_id: str, route: str, params: dict[str, Any]) -> None:
        if not params.get("remote_block_ids") or params.get("transfer_mode") == "push":
            return
        message = await self.client.release(params, engine_request_id(route, request_id))
        self.notified.append((reason, message.decode(errors="replace")))
        logger.info("D released P's blocks", extra={"reason": reason, "notification": message})
