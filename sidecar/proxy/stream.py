"""Judging a 200 stream from its first SSE event while the bytes pass through."""

from __future__ import annotations

from sidecar.classify import Event, Failure, FirstEvent, stream_event
from sidecar.decision.judge import Judge
from sidecar.proxy.context import Exchange
from sidecar.proxy.sse import FirstEventScanner


class StreamJudge:
    """Judges a 200 stream from its first SSE event while the bytes pass through."""

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
            self._judged(first)

    def finish(self) -> None:
        if not self._exchange.decided:
            self._judged(self._scanner.finish())

    def _judged(self, first: FirstEvent) -> None:
        if first.error_code is not None:  # an error event: it may show D's engine dead
            self._judge.observe(first.error_code, first.error_message)
        self._judge.judge(self._exchange, stream_event(first), first.error_type)

    def reset(self) -> None:
        """D broke the stream before its first event ended: D may have admitted it."""
        if not self._exchange.decided:
            self._judge.judge(self._exchange, Event(failure=Failure.RESET_AFTER_SEND))
