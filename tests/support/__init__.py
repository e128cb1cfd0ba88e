"""What the test suites share: one place for each helper, no test module importing another.

- ``ports``: ``free_port``, the one way a test picks a port for another process to bind.
- ``until``: ``until`` (and ``until_async``, the same poll on an event loop): readiness and
  state polled, never slept on; ``answered`` polls a URL.
"""
