"""The sidecar's HTTP servers: ``serve`` (the command: listeners, signals, ordered shutdown),
``protocol`` (the HTTP/1.1 server protocol on llhttp, with the client limits) and ``cycle`` (one
request's ASGI receive and send), ``host`` (the uvicorn servers they run in, the one module that
uses uvicorn), ``limits`` (what a server enforces on its clients), ``accept`` (every waiting
connection taken at once), ``workers`` and ``worker`` (N serving processes on inherited sockets),
``scratch`` (their private directory in shared memory, and the sweep of those killed supervisors
left) and ``memory`` (the allocator's settings)."""
