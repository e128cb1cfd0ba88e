"""The sidecar's HTTP servers: ``serve`` (the command: listeners, signals, ordered shutdown),
``protocol`` (uvicorn's httptools protocol with the client limits it lacks, the one module that
touches uvicorn's internals), ``limits`` (what a server enforces on its clients), ``accept``
(every waiting connection taken at once), ``workers`` and ``worker`` (N serving processes on
inherited sockets), ``scratch`` (their private directory in shared memory, and the sweep of those
killed supervisors left) and ``memory`` (the allocator's settings). One write per head and body is
``sidecar.transport.coalesce``."""
