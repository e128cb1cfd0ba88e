"""``make e2e``: the sidecar between two real vLLM engines (a CPU build, NIXL over loopback).

``python -m tests.e2e`` (from the project's environment) makes a tiny model,
starts a prefill engine P and a decode engine D from the engines' own
environment (``tests.e2e.setup_env`` builds it), puts sidecars in front of D,
runs every scenario of ``tests.e2e.scenarios`` and judges each from P's own
evidence: P's ``/metrics`` and P's log lines. Nothing under ``sidecar/``
imports this package, and nothing here imports torch or vLLM: the engines are
child processes.
"""
