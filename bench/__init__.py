"""``python -m bench`` (``make bench``): the sidecar against the direct path, as ratios.

One run starts the fake decode server D (``kv-release-sidecar sim-decode``),
the sidecar in front of it, and two reference hops in front of it too, as
separate processes: the relay (``python -m bench.relay``, a zero-logic byte
relay, the cheapest hop Python can run) and, when an ``nginx`` binary is on
``PATH`` or given with ``--nginx``, nginx (skipped otherwise). It drives
every path (client -> D, client -> sidecar -> D, client -> relay -> D,
client -> nginx -> D) with the same closed-loop aiohttp load generator and
the same settings, in short rounds whose order rotates, and prints each
figure with its ratio to direct plus PASS/MISS against the targets. The
targets judge the sidecar against direct; the reference hops are columns
beside them, with a line each saying what the sidecar adds over them for
SSE time to first byte: the floor any hop pays in this layout, measured in
the same run. Raw figures go to ``out/bench.json``.

Core layout on the 2-core machine: the sidecar gets a core of its own
(``sched_setaffinity`` in the child before exec, so every thread inherits
it), shared only with the reference hops, which are idle while the sidecar
is measured; D and the load generator (this process) share the other. The
direct path is therefore limited by that shared core, and a proxied path
adds the proxy's own core: the req/s ratio is about the proxy keeping up,
not about who gets more CPU. Each server runs in its own session (its own
scheduling group), as separate services would. Other processes busy on the
same cores distort every figure, so their CPU is measured and reported.

Modules: ``settings`` (the knobs, full and quick), ``procs`` (processes,
pinning, readiness, ``/proc`` readings), ``relay`` (the reference relay),
``load`` (the load generator), ``noise`` (other processes' CPU on our
cores), ``stats`` (percentiles), ``report`` (figures, ratios, targets,
table, JSON), ``run`` (the sequence of rounds and phases), ``cli`` (flags,
exit codes).
"""
