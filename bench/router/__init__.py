"""Router mode's benches: ``python -m bench.router [--quick] [--json PATH]`` (the router path against
a client running both legs itself through a plain sidecar) and ``python -m bench.router.inproc
[--baseline DIR]`` (router mode's own Python per stream, P and D faked, beside another tree).

``run`` (the two paths in counted phases) and ``inproc`` (the in-process samples).
"""
