"""``python -m bench`` (``--workload paths``, the default): JSON and SSE requests through the sidecar,
beside the direct path to D and the reference hops (the relay, and nginx when its binary is there).

``settings`` (the knobs, full and quick), ``launch`` (D, the sidecar and the
hops as child processes), ``measure`` (one phase on one path, pooled over
rounds), ``wrk`` (wrk, its script and its output, for the JSON phases),
``saturation`` (who filled a core), ``report`` (figures, ratios, costs,
targets), ``render`` (the table) and ``run`` (the sequence of rounds and
phases). ``bench.cli`` reads the flags and picks the JSON load generator.
"""
