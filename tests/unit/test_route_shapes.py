"""The shapes of the two newer routes' answers as the proxy reads them, and P's lease in router mode."""

from __future__ import annotations

import pytest

from sidecar.classify import Outcome, classify, stream_event
from sidecar.decision.sse import parse_event
from sidecar.proxy.handler import _error
from sidecar.release.hold import lease_seconds, release_by


@pytest.mark.parametrize(
    ("event", "code", "outcome"),
    [
        # 0.33.0: Anthropic's names for a 4xx: a refusal before the engine had the request
        (
            b'event: error\ndata: {"type":"error","error":{"type":"invalid_request_error","message":"m"}}',
            400,
            Outcome.RELEASE,
        ),
        (
            b'event: error\ndata: {"type":"error","error":{"type":"not_found_error","message":"m"}}',
            400,
            Outcome.RELEASE,
        ),
        # no status to read: never released
        (
            b'event: error\ndata: {"type":"error","error":{"type":"api_error","message":"m"}}',
            None,
            Outcome.NO_RELEASE,
        ),
        (
            b'event: error\ndata: {"type":"error","error":{"type":"overloaded_error","message":"m"}}',
            None,
            Outcome.NO_RELEASE,
        ),
        # before 0.33.0 the type is vLLM's own, which does not say the status
        (
            b'event: error\ndata: {"type":"error","error":{"type":"BadRequestError","message":"m"}}',
            None,
            Outcome.NO_RELEASE,
        ),
        (
            b'event: message_start\ndata: {"type":"message_start","message":{"id":"x"}}',
            None,
            Outcome.NO_RELEASE,
        ),
        # OpenAI's shape keeps its code, whatever the envelope's type says
        (
            b'data: {"type":"error","error":{"type":"BadRequestError","message":"m","code":400}}',
            400,
            Outcome.RELEASE,
        ),
    ],
)
def test_first_event_of_a_messages_stream(event: bytes, code: int | None, outcome: Outcome) -> None:
    first = parse_event(event)
    assert first.error_code == code
    assert classify(stream_event(first)).outcome is outcome


@pytest.mark.parametrize(
    ("body", "found"),
    [
        (
            b'{"type":"error","error":{"type":"invalid_request_error","message":"too long"}}',
            ("invalid_request_error", "too long"),
        ),
        (
            b'{"error":{"message":"m","type":"BadRequestError","param":null,"code":400}}',
            ("BadRequestError", "m"),
        ),
        (b'{"type":"message","error":{"type":"x","message":"m"}}', (None, None)),  # not an error envelope
        (b'{"detail":"Not Found"}', (None, None)),
    ],
)
def test_error_bodies_of_both_shapes(body: bytes, found: tuple[str | None, str | None]) -> None:
    assert _error(body) == found


@pytest.mark.parametrize(
    ("version", "configured", "lease"),
    [
        ("0.33.0", 0.0, 30.0),
        ("0.22.0", 0.0, 30.0),
        ("0.21.0", 0.0, 480.0),
        ("0.10.0", 0.0, 120.0),
        ("0.9.2", 0.0, None),  # no lease before 0.10.0: P holds the blocks until notified
        (None, 0.0, 30.0),  # unknown: the shortest lease
        ("0.9.2", 12.0, 12.0),  # configured wins
    ],
)
def test_lease_by_release(version: str | None, configured: float, lease: float | None) -> None:
    assert lease_seconds(version, configured) == lease


@pytest.mark.parametrize(("lease", "margin"), [(30.0, 3.0), (480.0, 5.0), (1.0, 0.1)])
def test_release_by_keeps_a_margin_of_the_lease(lease: float, margin: float) -> None:
    assert release_by(100.0, lease) == pytest.approx(100.0 + lease - margin)
