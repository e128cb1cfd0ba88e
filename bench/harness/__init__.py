"""What every bench is built from: its child processes and cores, the Python load generator, other
processes' CPU on the benchmark's cores, percentiles, rounds in a rotating order, the parts every
report shares, py-spy, and a bench's command line.

``procs`` (child processes: start, pin, wait until ready, read ``/proc``, stop; the two-core
plan), ``load`` (the Python load generator), ``noise`` (other processes' CPU), ``stats``
(percentiles), ``rounds`` (the rotating order of paths, and phases of a fixed count of requests),
``settings`` (knobs every bench shares), ``report`` (the fields and readings every report
shares, and its JSON), ``profile`` (py-spy on a sidecar), ``main`` (a bench's flags, run, table
and exit code). Nothing here imports a workload.
"""
