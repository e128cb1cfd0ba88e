"""The style of the sidecar's own answers, picked once at start: vLLM's, or llm-d's.

``VLLM`` answers every failure in vLLM's OpenAI error shape
(``sidecar.proxy.answers``). ``LLMD`` keeps the bodies llm-d's routing
sidecar gives, so nothing a client behind llm-d parses changes
(``sidecar.proxy.llmd_answers``): D refusing connections is its plain 503, a
prefiller outside the allowlist its plain-text 403, and a prefill leg runs on
the one P the request names, whose failure reaches the client as it is.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sidecar.asgi import Send
from sidecar.classify import Failure
from sidecar.proxy.answers import Header, send_error
from sidecar.proxy.llmd_answers import DECODE_NOT_READY, FORBIDDEN, send_plain


@dataclass(frozen=True, slots=True)
class AnswerStyle:
    """One style of the sidecar's own answers (see the module docstring)."""

    name: str
    decode_not_ready: bytes | None = None  # the plain body D refusing connections is answered with
    forbidden: bytes | None = None  # the plain body a prefiller outside the allowlist gets (403)
    one_prefill: bool = False  # one P per prefill leg, its failure passed on as it is

    async def decode_failed(
        self,
        send: Send,
        failure: Failure,
        status: int,
        message: str,
        request_id: str,
        extra: Sequence[Header] = (),
    ) -> None:
        """D gave no answer (``failure``): the client's ``status`` with ``message``."""
        if self.decode_not_ready is not None and failure is Failure.CONNECT_REFUSED:
            await send_plain(send, status, self.decode_not_ready, request_id, extra, sniffed=True)
            return
        await send_error(send, status, message, request_id, extra=extra)

    async def prefill_refused(
        self, send: Send, status: int, message: str, request_id: str, param: str | None
    ) -> None:
        """The prefill leg cannot run (a bad or unlisted ``x-prefiller-host-port``)."""
        if status == 403 and self.forbidden is not None:
            await send_plain(send, 403, self.forbidden, request_id)
            return
        await send_error(send, status, message, request_id, param)


VLLM = AnswerStyle("vllm")
LLMD = AnswerStyle("llm-d", decode_not_ready=DECODE_NOT_READY, forbidden=FORBIDDEN, one_prefill=True)
STYLES = {style.name: style for style in (VLLM, LLMD)}
