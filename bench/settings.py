"""The benchmark's knobs: one frozen struct, with a full and a quick preset.

Counts are fixed per phase (every phase stops by itself once its count is
done); the time bounds stop a phase early when the servers are slow or stall,
so a run never takes much longer than ``run_budget`` whatever the machine
does. On a quiet 2-core machine the full preset takes about a minute and the
quick one, the smoke run of the test suite, a few seconds.
"""

from __future__ import annotations

import msgspec


class Settings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How much load each phase sends, and the bounds that keep the run short."""

    # Non-streaming JSON requests per path and round, at 1 and at 32 connections.
    json_c1_requests: int
    json_c32_requests: int
    # 64-event SSE streams per path and round.
    sse_streams: int
    sse_concurrency: int = 1
    stream_events: int = 64
    # Requests sent (and discarded) per path before each measured phase: opens the
    # connections of both hops and warms both servers' code paths.
    warmup_requests: int
    # Each round measures direct then sidecar; odd rounds swap the order (ABBA) so
    # drift over the run does not favour either path.
    rounds: int
    # Hard time limits: of one measured phase, of one warm-up, and of all measured phases
    # together (each phase gets at most an even share of what is left of ``run_budget``).
    phase_bound: float = 15.0
    warmup_bound: float = 5.0
    run_budget: float = 100.0
    request_timeout: float = 30.0
    ready_timeout: float = 30.0

    def __post_init__(self) -> None:
        for name in msgspec.structs.asdict(self):
            if getattr(self, name) <= 0:
                raise ValueError(f"invalid {name} = {getattr(self, name)!r}: must be positive")


FULL = Settings(
    json_c1_requests=3000,
    json_c32_requests=12000,
    sse_streams=1500,
    warmup_requests=300,
    rounds=2,
)

QUICK = Settings(
    json_c1_requests=200,
    json_c32_requests=600,
    sse_streams=100,
    warmup_requests=50,
    rounds=1,
    phase_bound=10.0,
    run_budget=40.0,
)
