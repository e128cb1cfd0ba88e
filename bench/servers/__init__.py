"""The servers a bench runs beside the sidecar: the reference hops, and fakes of P and D fast enough
not to fill the load core first.

``relay`` (``python -m bench.servers.relay``: a TCP relay with no logic, the
cheapest hop Python can run), ``nginx`` (nginx's configuration as a reference
hop: keep-alive, no buffering) and ``fakes`` (``python -m bench.servers.fakes
--role prefill|reject``: a fake P answering prefill legs, or a D refusing every
completion the way vLLM's validation does).
"""
