"""``kv-release-sidecar loadtest``: an open-loop P->D load generator with a release verdict.

The package drives the full prefill/decode flow of vLLM's reference proxy
against a prefill node P and a decode node D (or the sidecar in front of
it), samples P's pinned KV blocks while it runs, and ends with a report and
a verdict that fails on any wrong release. Modules, leaves first:
``config`` (the frozen settings and flags), ``workload`` (prompts, bodies,
request kinds), ``flow`` (one P->D request), ``probes`` (P's and the
sidecar's counters), ``driver`` (arrivals), ``verdict``, ``report``,
``plot``, ``progress``, ``runner`` (one whole run) and ``command`` (the CLI).
"""
