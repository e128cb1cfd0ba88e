"""``python -m bench.p_peers [--quick] [--json PATH]``: what each sidecar NIXL agent connected to P
costs P (memory, fds, threads, CPU per handshake and per message).

``run`` (the steps and the readings), ``procs`` (the child processes, P's one
agent and its peers: ``python -m bench.p_peers.procs``) and ``report`` (the
figures and the table).
"""
