"""Judging a 200 stream from its first SSE event while the bytes pass through."""

from __future__ import annotations

from sidecar.classify import Event, NoAnswer, stream_event
from sidecar.decision.judge import Judge
from sidecar.proxy.context import Exchange
from sidecar.proxy.sse import FirstEventScanner


class StreamJudge:
    """Judges a 200 stream from its first SSE event while the bytes pass through. What the
    stream's head showed of D (``Connection: close``) was told when it arrived
    (``sidecar.proxy.forward``), so its events here carry only what they show themselves."""

    __slots__ = ("_exchange", "_judge", "_scanner")

    def __init__(self, judge: Judge, exchange: Exchange) -> None:
        self._judge, self._exchange = judge, exchange
        self._scanner = FirstEventScanner(skip_lead=exchange.route == "/v1/responses")

    @property
    def decided(self) -> bool:
        """The stream is judged: the rest of it needs no look."""
        return self._exchange.decided

    def feed(self, chunk: bytes) -> None:
        if self._exchange.decided:
            return
        first = self._scanner.feed(chunk)
        if first is not None:
            self._judged(stream_event(first))

    def finish(self) -> None:
        if not self._exchange.decided:
            self._judged(stream_event(self._scanner.finish()))

    def reset(self) -> None:
        """D broke the stream before its first event ended: D may have admitted it."""
        if not self._exchange.decided:
            self._judged(Event(failure=NoAnswer.RESET_AFTER_SEND, started=True))

    def _judged(self, event: Event) -> None:
        self._judge.judge(self._exchange, event)
