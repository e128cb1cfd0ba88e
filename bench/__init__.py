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

Two more workloads share its parts: ``--workload streams`` (``streams``,
``streams_report``; thousands of concurrent SSE streams in sidecar and router
mode, driven by the C load generator and fake D of ``streams.c`` through
``cstreams``, with ``fast_servers`` as the fake P; ``vllm_router`` starts
vLLM's own P/D router beside router mode and ``streams_versus`` reads the
two side by side, and the accept burst at one and two workers) and ``--workload releases``
(``releases``, ``releases_load``, ``releases_report``; a steady rate of
rejected requests, P's own record of when it got its blocks back, with
``fast_servers`` as the rejecting D and ``storm_procs``' servers).

Modules: ``settings`` (the knobs, full and quick), ``procs`` (processes,
pinning, readiness, ``/proc`` readings), ``relay`` (the reference relay),
``load`` (the Python load generator), ``wrk`` (wrk, its script and its
output), ``measure`` (one phase on one path, pooled over rounds; peak
readings), ``saturation`` (who filled a core), ``noise`` (other processes'
CPU on our cores), ``stats`` (percentiles), ``report`` (figures, ratios,
costs, targets, JSON), ``render`` (the tables), ``run`` (the sequence of
rounds and phases), ``cli`` (flags, exit codes, every bench's main).

The benches run as modules of their own are built from the same parts:
``bench_storm`` (a rejection storm beside other requests; its servers in
``storm_procs``, its load in ``storm_load`` and ``storm_worker``, its figures
in ``storm_report``), ``bench_router`` and ``bench_tracing`` (phases of a
count of requests, ``run.counted_rounds``), ``bench_p_peers`` (what each
sidecar NIXL agent connected to P costs P; its child processes in
``p_peers_procs``, its figures in ``p_peers_report``), and
``bench_router_inproc`` (router mode's own Python per stream, P and D faked,
beside another tree).
"""
