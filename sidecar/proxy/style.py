"""The style of the sidecar's own answers, picked once at start: vLLM's, or llm-d's.

``VLLM`` answers every failure in vLLM's OpenAI error shape
(``sidecar.proxy.answers``). ``LLMD`` keeps the bodies llm-d's routing
sidecar gives, so nothing a client behind llm-d parses changes
(``sidecar.proxy.llmd_answers``): D refusing connections is its plain 503, a
prefiller outside the allowlist its plain-text 403, a 503 the sidecar gives
itself llm-d's flat error body, and a prefill leg runs on the one P the
request names, whose failure reaches the client as it is. Beyond the answers,
``LLMD`` serves what llm-d's sidecar serves: ``GET /health`` on the serving
port, rank 0's table of data-parallel listeners with a single rank too, and
``x-prefiller-host-port`` taking the router's path with no prefill allowlist
configured (every prefiller refused then, unless the pool's pods are the list).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sidecar.asgi import Send
from sidecar.classify import NoAnswer
from sidecar.proxy.answers import Header, send_error
from sidecar.proxy.llmd_answers import DECODE_NOT_READY, FORBIDDEN, flat_error, send_plain


@dataclass(frozen=True, slots=True)
class AnswerStyle:
    """One style of the sidecar's own answers (see the module docstring)."""

    name: str
    decode_not_ready: bytes | None = None  # the plain body D refusing connections is answered with
    forbidden: bytes | None = None  # the plain body a prefiller outside the allowlist gets (403)
    one_prefill: bool = False  # one P per prefill leg, its failure passed on as it is
    flat_unavailable: bool = False  # the sidecar's own 503 in llm-d's flat shape, sent as plain text
    serves_health: bool = False  # the serving port answers GET (and HEAD) /health 200 itself
    keeps_rank_table: bool = False  # rank 0 reads x-data-parallel-host-port with a single rank too
    routes_unlisted: bool = False  # router mode with no prefill list: the header names P (checked)

    async def decode_failed(
        self,
        send: Send,
        failure: NoAnswer,
        status: int,
        message: str,
        request_id: str,
        extra: Sequence[Header] = (),
    ) -> None:
        """D gave no answer (``failure``): the client's ``status`` with ``message``."""
        if self.decode_not_ready is not None and failure is NoAnswer.CONNECT_REFUSED:
            await send_plain(send, status, self.decode_not_ready, request_id, extra, sniffed=True)
            return
        await send_error(send, status, message, request_id, extra=extra)

    async def unavailable(self, send: Send, message: str, request_id: str) -> None:
        """503 with ``message``: the sidecar cannot serve the request yet."""
        if self.flat_unavailable:  # as Go sends an untyped body: sniffed as text
            await send_plain(send, 503, flat_error(message), request_id, sniffed=True)
            return
        await send_error(send, 503, message, request_id)

    async def prefill_refused(
        self, send: Send, status: int, message: str, request_id: str, param: str | None
    ) -> None:
        """The prefill leg cannot run (a bad or unlisted ``x-prefiller-host-port``)."""
        if status == 403 and self.forbidden is not None:
            await send_plain(send, 403, self.forbidden, request_id)
            return
        await send_error(send, status, message, request_id, param)


VLLM = AnswerStyle("vllm")
LLMD = AnswerStyle(
    "llm-d",
    decode_not_ready=DECODE_NOT_READY,
    forbidden=FORBIDDEN,
    one_prefill=True,
    flat_unavailable=True,
    serves_health=True,
    keeps_rank_table=True,
    routes_unlisted=True,
)
STYLES = {style.name: style for style in (VLLM, LLMD)}
