"""``python -m bench --workload streams``: thousands of concurrent SSE streams through each hop, in
sidecar mode and in router mode, router mode beside vLLM's own P/D router.

``run`` (the settings, the servers, the phases of every round), ``cstreams``
(the C load generator and fake D of ``streams.c``: built, started, read),
``vllm_router`` (vLLM's P/D router as a hop), ``report`` (the figures per
round, mode and path; targets), ``versus`` (router mode beside vllm-router,
one worker beside two) and ``render`` (the table). The fake P is
``bench.servers.fakes``.
"""
