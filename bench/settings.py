"""The benchmark's knobs: one frozen struct, with a full and a quick preset.

Counts are fixed per path and phase, and split evenly over the rounds (every
phase stops by itself once its count is done); the time bounds stop a phase
early when the servers are slow or stall, so a run never takes much longer
than ``run_budget`` per path whatever the machine does. On a quiet 2-core
machine the full preset takes under a minute with three paths (direct,
sidecar, relay) and a little over a minute with nginx as a fourth; the quick
one, the smoke run of the test suite, about a second per path.
"""

from __future__ import annotations

import math

import msgspec


class Settings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How much load each phase sends, and the bounds that keep the run short."""

    # Non-streaming JSON requests per path, at 1 and at 32 connections, over all rounds.
    json_c1_requests: int
    json_c32_requests: int
    # 64-event SSE streams per path, over all rounds.
    sse_streams: int
    sse_concurrency: int = 1
    stream_events: int = 64
    # Requests sent (and discarded) per path before each measured phase of each round:
    # opens the connections of every hop and warms the servers' code paths.
    warmup_requests: int
    # At least this many rounds; a run rounds it up to a multiple of its number of paths.
    # Round r measures every path, in the base order rotated to start at path r mod N, so
    # each path takes each position equally often and drift over the run favours none.
    rounds: int
    # Hard time limits: of one measured phase, of one warm-up, and of all measured phases
    # of one path (a run's budget is that times its number of paths; each measured phase
    # gets at most an even share of what is left of it).
    phase_bound: float = 15.0
    warmup_bound: float = 5.0
    run_budget: float = 40.0
    request_timeout: float = 30.0
    ready_timeout: float = 30.0

    def __post_init__(self) -> None:
        for name in msgspec.structs.asdict(self):
            if getattr(self, name) <= 0:
                raise ValueError(f"invalid {name} = {getattr(self, name)!r}: must be positive")

    def rounds_for(self, paths: int) -> int:
        """``rounds``, rounded up to a multiple of ``paths``."""
        return math.ceil(self.rounds / paths) * paths


FULL = Settings(
    json_c1_requests=6000,
    json_c32_requests=24000,
    sse_streams=6000,
    warmup_requests=100,
    rounds=6,
)

QUICK = Settings(
    json_c1_requests=200,
    json_c32_requests=600,
    sse_streams=100,
    warmup_requests=50,
    rounds=1,
    phase_bound=10.0,
    run_budget=15.0,
)
