"""The paths workload's knobs (``python -m bench``), with a full and a quick preset.

The JSON phases
run for a fixed time per path (split evenly over the rounds; wrk takes whole
seconds, so a round's share is rounded up to one); the SSE phase sends a
fixed number of streams per path, split the same way, with a time bound that
stops it early when the servers are slow or stall. On a quiet 2-core machine
the full preset takes about a minute per path (four with nginx); the quick
one, the smoke run of the test suite, a few seconds per path.
"""

from __future__ import annotations

import math

from bench.harness.settings import Knobs


class Settings(Knobs, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How much load each phase sends, and the bounds that keep the run short."""

    # Seconds of non-streaming JSON requests per path, at 1 and at 32 connections, over all rounds.
    json_c1_seconds: float
    json_c32_seconds: float
    # SSE streams per path, over all rounds.
    sse_streams: int
    sse_concurrency: int = 1
    # Tokens in every answer of the fake D (one SSE event each), and the request's max_tokens.
    answer_tokens: int = 128
    # Requests sent (and discarded, but checked) per path before each measured phase of each
    # round: opens the connections of every hop and warms the servers' code paths.
    warmup_requests: int
    # At least this many rounds; a run rounds it up to a multiple of its number of paths.
    # Round r measures every path, in the base order rotated to start at path r mod N, so
    # each path takes each position equally often and drift over the run favours none.
    # One round (a smoke run) measures every path once, in the base order.
    rounds: int
    # Hard time limits: of one SSE phase, of one warm-up, and of all SSE phases of one path
    # (a run's budget is that times its number of paths; each SSE phase gets at most an
    # even share of what is left of it).
    phase_bound: float = 15.0
    warmup_bound: float = 5.0
    run_budget: float = 40.0

    def rounds_for(self, paths: int) -> int:
        """``rounds``, rounded up to a multiple of ``paths`` (one round stays one)."""
        return 1 if self.rounds == 1 else math.ceil(self.rounds / paths) * paths


FULL = Settings(json_c1_seconds=8.0, json_c32_seconds=24.0, sse_streams=6000, warmup_requests=100, rounds=6)
QUICK = Settings(
    json_c1_seconds=0.5, json_c32_seconds=1.0, sse_streams=100, warmup_requests=50, rounds=1,
    phase_bound=10.0, run_budget=15.0,
)  # fmt: skip
