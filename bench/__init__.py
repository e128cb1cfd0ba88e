"""``python -m bench`` (``make bench``): the sidecar against the direct path, as ratios.

One run starts the fake decode server D (``kv-release-sidecar sim-decode``)
and the sidecar in front of it as separate processes, drives both paths
(client -> D and client -> sidecar -> D) with the same closed-loop aiohttp
load generator and the same settings, back to back, and prints each figure
with its ratio to direct plus PASS/MISS against the targets. Raw figures go
to ``out/bench.json``.

Core layout on the 2-core machine: the sidecar gets a core of its own
(``sched_setaffinity`` in the child before exec, so every thread inherits
it); D and the load generator (this process) share the other. The direct
path is therefore limited by that shared core, and the sidecar path adds
the sidecar's own core: the req/s ratio is about the sidecar keeping up,
not about who gets more CPU. Each server runs in its own session (its own
scheduling group), as separate services would. Other processes busy on the
same cores distort every figure, so their CPU is measured and reported.

Modules: ``settings`` (the knobs, full and quick), ``procs`` (processes,
pinning, readiness, ``/proc`` readings), ``load`` (the load generator),
``noise`` (other processes' CPU on our cores), ``stats`` (percentiles),
``report`` (figures, ratios, targets, table, JSON), ``run`` (the sequence
of phases), ``cli`` (flags, exit codes).
"""
