"""Knobs every bench shares: the start-up and request timeouts, and a count of requests per phase.

``Knobs`` is the base of the benches' frozen settings structs (every knob
must be positive); ``CountedSettings`` is the load of the benches whose phases
send a count of requests (``bench.harness.rounds``), each with its presets in its
own module.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec


class Knobs(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What every bench that starts servers has; all its knobs must be positive."""

    # Seconds for every server to answer ready, and for one request to be answered.
    ready_timeout: float = 30.0
    request_timeout: float = 30.0

    def __post_init__(self) -> None:
        for name in msgspec.structs.asdict(self):
            if getattr(self, name) <= 0:
                raise ValueError(f"invalid {name} = {getattr(self, name)!r}: must be positive")


@dataclass(frozen=True, slots=True, kw_only=True)
class CountedSettings:
    """Load per phase, as a count of requests, and the bounds that keep the run short."""

    requests: dict[int, int]  # connections -> requests per path and round (a phase may stop early)
    warmup: int  # requests per connection before each measured phase
    rounds: int
    total_bound: float  # seconds for the measured phases and shutdown, after start-up (ready_timeout)
    ready_timeout: float = 30.0
    request_timeout: float
    shutdown_reserve: float  # kept back from the measured phases for stopping the children
