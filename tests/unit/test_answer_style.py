"""The answer style picked at start: what each style says to the places that ask it."""

from __future__ import annotations

import pytest

from sidecar.config import Config
from sidecar.network.allowlist import Allowlist
from sidecar.proxy.answers import DECODE_NOT_READY, LLMD, STYLES, VLLM, AnswerStyle, flat_error
from sidecar.router.pool import PrefillPool


def test_styles_are_picked_by_the_config_value() -> None:
    assert STYLES["vllm"] is VLLM and STYLES["llm-d"] is LLMD


def test_llm_d_flat_body_is_the_one_llm_d_writes() -> None:
    message = (
        "The decode node is not ready. Please check that the vLLM service is running and the port "
        "configuration is correct."
    )
    assert flat_error(message) == DECODE_NOT_READY


@pytest.mark.parametrize(
    ("style", "expected"),
    [(VLLM, (False, False, False, False, False)), (LLMD, (True, True, True, True, True))],
    ids=["vllm", "llm-d"],
)
def test_what_each_style_serves(style: AnswerStyle, expected: tuple[bool, ...]) -> None:
    asked = (
        style.one_prefill,
        style.flat_unavailable,
        style.serves_health,
        style.keeps_rank_table,
        style.routes_unlisted,
    )
    assert asked == expected


@pytest.mark.parametrize(("style", "routed"), [(VLLM, False), (LLMD, True)], ids=["vllm", "llm-d"])
def test_no_prefill_list_takes_the_router_path_only_with_llm_d_answers(
    style: AnswerStyle, routed: bool
) -> None:
    pool = PrefillPool.of(Config(), Allowlist(()), style)
    assert (pool is not None) is routed
