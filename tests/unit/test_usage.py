"""Router mode's ``cached_tokens`` correction of D's SSE events, however D's bytes are cut."""

from __future__ import annotations

import msgspec
import pytest

from sidecar.proxy.usage import UsageRewriter

USAGE = {"prompt_tokens": 9, "prompt_tokens_details": {"cached_tokens": 0}}
STREAM = (
    b'data: {"choices":[{"delta":{"content":"a"}}]}\n\n'
    b'data: {"choices":[{"delta":{"content":"b"}}]}\n\n'
    b"data: " + msgspec.json.encode({"choices": [], "usage": USAGE}) + b"\n\n"
    b"data: [DONE]\n\n"
)
CORRECTED = STREAM.replace(b'"cached_tokens":0', b'"cached_tokens":7')


def _fed(parts: list[bytes]) -> bytes:
    rewriter = UsageRewriter(7, stream=True)
    return b"".join(rewriter.feed(part) for part in parts) + rewriter.flush()


@pytest.mark.parametrize("cut", range(1, len(STREAM)))
def test_every_cut_of_the_stream_gives_the_corrected_stream(cut: int) -> None:
    assert _fed([STREAM[:cut], STREAM[cut:]]) == CORRECTED


def test_one_event_a_part_passes_as_it_is_or_corrected() -> None:
    events = [event + b"\n\n" for event in STREAM.split(b"\n\n")[:-1]]
    rewriter = UsageRewriter(7, stream=True)
    out = [rewriter.feed(event) for event in events]
    assert out[:2] == events[:2]  # nothing to correct: as they came
    assert b"".join(out) == CORRECTED and rewriter.flush() == b""


def test_a_partial_event_is_held_back_until_it_ends() -> None:
    rewriter = UsageRewriter(7, stream=True)
    assert rewriter.feed(b"data: {") == b""
    assert rewriter.feed(b'"x":1}\n\n') == b'data: {"x":1}\n\n'
