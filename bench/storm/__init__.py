"""``python -m bench.storm [--quick] [--json PATH]``: releases per second sustained in a rejection
storm, and what the storm does to the other requests through the same sidecar.

``run`` (the settings, the phases, the figures), ``load`` (the other requests,
and the storm generator driven as a child process), ``worker`` (that child:
``python -m bench.storm.worker``) and ``report`` (the figures and the table).
P, D and the sidecar are started by ``bench.releases.launch`` and read by
``bench.releases.metrics``.
"""
