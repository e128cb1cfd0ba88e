"""``python -m bench`` (``make bench``): the sidecar beside the direct path and two reference hops.

One run starts the fake decode server D (``kv-release-sidecar sim-decode``),
the sidecar in front of it, and two reference hops in front of it too, as
separate processes: the relay (``python -m bench.servers.relay``, a zero-logic byte
relay, the cheapest hop Python can run) and, when an ``nginx`` binary is on
``PATH`` or given with ``--nginx``, nginx (skipped otherwise). It drives
every path (client -> D, client -> sidecar -> D, client -> relay -> D,
client -> nginx -> D) with the same load and settings, in short rounds whose
order rotates. The JSON phases are driven by wrk (a C load generator, one
thread) when it is installed, by the Python load generator otherwise (the
output says so); the SSE phase always by the Python one, which times the
first bytes of each stream. For every path the report gives its figures,
each hop's ratios to direct, its CPU per request and what one core of it
could serve, its idle and loaded RSS, and each process's share of its core
with what saturated; the sidecar's targets are judged beside them. Raw
figures go to ``out/bench.json``.

Core layout on the 2-core machine: the hops get a core of their own
(``sched_setaffinity`` in the child before exec, so every thread inherits
it), one measured at a time; D and the load generators (this process, and
wrk, which inherits its affinity) share the other. The direct path is
therefore limited by that shared core, and a proxied path adds the hop's own
core: the req/s ratio is about the hop keeping up, not about who gets more
CPU. Each server runs in its own session (its own scheduling group), as
separate services would. Other processes busy on the same cores distort
every figure, so their CPU is measured and reported.

Every workload is a package of its own, and so are the parts they share:

- ``harness`` (what every bench is built from: child processes and the
  two-core plan, the Python load generator, other processes' CPU,
  percentiles, rounds and counted phases, the reports' shared fields, py-spy,
  a bench's command line) and ``servers`` (the reference relay, nginx's
  configuration, the fast fakes of P and D). Neither imports a workload.
- ``paths`` (``python -m bench``, the default workload above), ``streams``
  (``--workload streams``: thousands of concurrent SSE streams in sidecar and
  router mode, beside vLLM's own P/D router) and ``releases``
  (``--workload releases``: a steady rate of rejected requests, P's own
  record of when it got its blocks back). ``cli`` reads the flags of all
  three.
- ``storm`` (``python -m bench.storm``: a rejection storm beside other
  requests, on the servers and readings of ``releases``), ``router``
  (``python -m bench.router``: the router path against a client running both
  legs; ``python -m bench.router.inproc``: router mode's own Python per
  stream), ``tracing`` (``python -m bench.tracing``: tracing off and on),
  ``p_peers`` (``python -m bench.p_peers``: what each sidecar NIXL agent
  connected to P costs P), ``nixl_release`` (``python -m bench.nixl_release``:
  one release's latency and the release rate against real NIXL agents) and
  ``table`` (``python -m bench.table``: the workers' shared table per
  request).

Imports go one way: a workload imports ``harness`` and ``servers`` (and
``storm`` imports ``releases``), never back; a package's ``__init__`` imports
nothing (``tests/unit/test_bench_layout.py``).
"""
