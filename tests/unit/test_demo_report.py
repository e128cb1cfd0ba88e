"""The demo's headline and its note on rejection counts, from two runs' figures."""

from __future__ import annotations

from typing import Any

from sidecar.sim.demo.report import _why_rejections_differ, headline


def figures(**values: Any) -> dict[str, Any]:
    base = {"pinned_block_seconds": 0.0, "p_refused_no_blocks": 0.0, "refused_by_p": 0, "releases_sent": 0.0}
    return base | values


def test_the_headline_is_computed_from_both_runs() -> None:
    off = figures(pinned_block_seconds=1611.5, p_refused_no_blocks=97.0)
    on = figures(pinned_block_seconds=42.7, p_refused_no_blocks=0.0)
    assert headline(off, on) == (
        "with releases on: P's pinned block-seconds -97 %, P's refusals for lack of blocks 97 -> 0"
    )
    assert "+25 %" in headline(figures(pinned_block_seconds=100.0), figures(pinned_block_seconds=125.0))
    assert "n/a" in headline(figures(), figures())


def test_rejection_counts_are_explained_only_when_p_refused_more_without_releases() -> None:
    said = _why_rejections_differ(figures(refused_by_p=97), figures(refused_by_p=0, releases_sent=70.0))
    assert said[0].startswith("Why more rejections with releases on: with them off, P refused 97 requests")
    assert "never reached D" in said[0] and "estimate" in said[1]
    assert _why_rejections_differ(figures(refused_by_p=0), figures(refused_by_p=0)) == []
