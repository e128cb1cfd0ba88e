"""What the test suites share: one place for each helper, no test module importing another.

Fixtures live in the ``conftest.py`` files; a helper one suite alone uses sits beside that suite in
a module that holds no test (``tests/faults/cluster.py``, ``tests/integration/workers.py``, ...).

- ``ports``: ``free_port``, the one way a test picks a port for another process to bind.
- ``until``: ``until`` (and ``until_async``, the same poll on an event loop): readiness and
  state polled, never slept on; ``answered`` polls a URL.
- ``runner``: how tests start a sidecar, in this process (``run_sidecar``) or as a child.
- ``sims``: P and D simulators as the tests drive them, and the request bodies clients send.
- ``fakes``: fakes at the proxy's seams (the upstream client, D, a releaser, a transport);
  ``fake_p`` P on real NIXL agents;
  ``fake_engine`` vLLM's engine client and a vLLM-like app with the plugin; ``fake_kube`` the
  Kubernetes API; ``ranked`` D's data-parallel ranks; ``certs`` TLS material;
  ``nixl_layouts`` vLLM's NIXL metadata layouts.
- ``emulation``: whether the suite runs under CPU emulation; ``index``: whether a package index
  answers.

The server harness (``serve``: real uvicorn servers on ephemeral loopback ports, in a thread) is
the package's ``sidecar.sim.servers``, since ``make demo`` runs its cluster on the same one.
"""
