"""The sidecar's HTTP servers: ``serve`` (the command: listeners, signals, ordered shutdown) and
``protocol`` (uvicorn's httptools protocol with the client limits it lacks, the one module that
touches uvicorn's internals), with ``coalesce`` (one write per head and body) and ``memory``."""
