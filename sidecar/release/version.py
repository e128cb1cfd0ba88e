"""D's vLLM release as the strategies see it: asked at most once a minute, remembered while D is down.

P and D run the same release (vLLM's handshake compatibility hash includes
the version), so D's ``GET /version`` names P's wire format. The source is an
injected callable (``Runtime.decode_version`` in the app); a failing source
never fails a release: the last answer stays the best knowledge.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable

log = logging.getLogger("sidecar.release")

VERSION_TTL = 60.0  # re-ask D after this


class DecodeRelease:
    """A cached view of D's vLLM release."""

    def __init__(
        self, source: Callable[[], Awaitable[str | None]], clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._source = source
        self._clock = clock
        self._known: tuple[float, str] | None = None  # (fetched at, D's version)

    async def get(self) -> str | None:
        now = self._clock()
        if self._known is not None and now - self._known[0] < VERSION_TTL:
            return self._known[1]
        try:
            text = await self._source()
        except Exception as exc:  # an injected callable: never let it fail a release
            log.warning("asking D for its version failed", extra={"error": str(exc)})
            text = None
        if text:
            self._known = (now, text)
            return text
        # D unreachable: its last answer is still the best knowledge of P's release.
        return self._known[1] if self._known is not None else None
