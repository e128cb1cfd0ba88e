"""``python -m bench --workload releases``: a steady rate of rejected requests through the sidecar, and
how fast P gets its blocks back; its servers and readings serve the storm bench too.

``launch`` (P, D and the sidecar releasing over NIXL, as child processes),
``load`` (P's parameters made by real prefill legs, and the open-loop load of
rejected requests), ``metrics`` (the sidecar's ``/metrics`` and P's ``/stats``
between two scrapes), ``report`` (the steps' figures and the table) and
``run`` (the settings and the steps).
"""
