"""Who ran out of CPU during a phase: the hop, the load generator, D, or someone else.

A closed-loop benchmark measures whatever saturates first. When it is the
hop's core, req/s is what the hop can do; when it is the load core (the
load generator and D share it), req/s says more about the load side than
about the hop, and a ratio to direct flatters every hop. Each phase's CPU
is read per process (D's and the hop's from ``/proc``, the load
generator's from its own clock) as cores' worth over the phase's wall time,
beside what other processes took of each core; ``bound`` names what hit
100 % of its core.
"""

from __future__ import annotations

from typing import Literal

import msgspec

# A process (or the two sharing the load core) at this share of one core or more is saturated:
# the tick-counted share of a busy core comes out a little under 1.
SATURATED = 0.95

Bound = Literal["proxy", "client", "decode", "other", "none"]


class PhaseLoad(msgspec.Struct, kw_only=True):
    """Cores' worth of CPU each process used during one path's measured phase, and what saturated.

    ``client``: the load generator; ``decode``: D; ``proxy``: the hop (0 on the direct path);
    ``other_load`` and ``other_hop``: other processes on the load core and on the hop's core.
    ``bound`` names the largest user of a full core: ``proxy`` (the hop's core), else
    ``client`` or ``decode`` (the load core; the load generator also when it alone took a
    core), ``other`` when other processes were the largest user of a full core, and
    ``none`` when no core was full (the phase was bound by latency, as at one connection).
    """

    client: float
    decode: float
    proxy: float
    other_load: float
    other_hop: float
    bound: Bound


def bound(client: float, decode: float, proxy: float, other: tuple[float, float] = (0.0, 0.0)) -> Bound:
    """What hit 100 % of its core, given each process's share of one core (``other``: other
    processes' on the load core and on the hop's core)."""
    other_load, other_hop = other
    hop_full = proxy > 0 and proxy + other_hop >= SATURATED
    if hop_full and proxy >= other_hop:
        return "proxy"
    if client >= SATURATED:
        return "client"
    if client + decode + other_load >= SATURATED:
        largest = max(client, decode, other_load)
        return "client" if client == largest else "decode" if decode == largest else "other"
    return "other" if hop_full else "none"


def phase_load(cpu: tuple[float, float, float], other: tuple[float, float], wall: float) -> PhaseLoad:
    """``cpu``: the client's, D's and the proxy's CPU seconds over ``wall`` seconds; ``other``: other
    processes' shares of the load core and of the hop's core."""
    client, decode, proxy = (seconds / wall if wall > 0 else 0.0 for seconds in cpu)
    return PhaseLoad(
        client=client,
        decode=decode,
        proxy=proxy,
        other_load=other[0],
        other_hop=other[1],
        bound=bound(client, decode, proxy, other),
    )
